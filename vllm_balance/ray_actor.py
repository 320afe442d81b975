"""Activation in Ray engine-core actors (``--data-parallel-backend ray``).

vLLM's ``CoreEngineActorManager`` (in the API server) resolves
``vllm.v1.engine.core.DPMoEEngineCoreActor`` by module-global name and Ray builds that class in
each actor; ``EngineCoreProc.run_engine_core``, where ``vllm_balance.activation`` decides for
vLLM's own launcher, never runs there, and the actor's bases were bound when vLLM's module was
defined. So the API server chooses (``activation.choose_ray_actor_class``, behind the
``registry.RAY_ACTOR_MANAGER_WRAPPER``) and the actor activates (this class's ``__init__``).
Ray pickles the class by reference: each actor imports it from here. Patching vLLM's classes
inside the actor instead could not work: ``ray.remote`` gives the actor a subclass holding its
own wrapped copy of every method, made in the API server.
"""

from __future__ import annotations

import inspect

from vllm.v1.engine.core import DPMoEEngineCoreActor

from vllm_balance.activation import BalanceConfigError, activate_for
from vllm_balance.shim.engine_core import BalanceDPEngineCoreProc


class BalanceDPMoEEngineCoreActor(DPMoEEngineCoreActor, BalanceDPEngineCoreProc):
    """vLLM's Ray engine-core actor with the balance gather (``registry.RAY_ACTOR_SWAP``).

    MRO: this class, ``DPMoEEngineCoreActor``, ``EngineCoreActorMixin``,
    ``BalanceDPEngineCoreProc``, ``DPEngineCoreProc``: upstream's ``__init__`` runs as it is (it
    calls ``DPEngineCoreProc.__init__`` by name), the gather comes from ``BalanceDPEngineCoreProc``.
    """

    def __init__(self, *args, **kwargs) -> None:
        # Ray passes every argument by keyword; bound to upstream's signature either way.
        given = inspect.signature(DPMoEEngineCoreActor.__init__).bind(self, *args, **kwargs)
        given.apply_defaults()
        arguments = given.arguments
        if not activate_for(
            arguments["vllm_config"],
            arguments.get("log_stats"),
            arguments.get("dp_rank"),
            engine_core=BalanceDPMoEEngineCoreActor,
        ):
            # The API server saw balance apply to this very config; an actor that disagrees
            # (another environment: the deprecated variable) would gather with vLLM's scheduler.
            raise BalanceConfigError(
                "balance scheduling: the API server chose the balance Ray engine-core actor, but "
                "this actor's config does not enable it; give every Ray node the same environment "
                "and --additional-config"
            )
        super().__init__(*args, **kwargs)
        # Upstream's __init__ calls DPEngineCoreProc.__init__ by name, so
        # BalanceDPEngineCoreProc.__init__, which hands the DP group to the scheduler, never runs
        # here, and vLLM assigned the group before the scheduler existed: hand it over now, or
        # every gather is a no-op (the gate never freezes).
        self.balance_scheduler.follow_dp_group(self.dp_group)
