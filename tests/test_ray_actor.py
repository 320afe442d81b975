"""Activation with the Ray DP backend: the API server chooses the actor class, the actor activates.

vLLM's ``CoreEngineActorManager.__init__`` (API server) resolves
``vllm.v1.engine.core.DPMoEEngineCoreActor`` by module-global name and Ray builds that class in
each actor, by reference; ``run_engine_core`` never runs there. Real vLLM classes and configs; the
actor's own construction stops where upstream's ``__init__`` begins (it would start the engine).
The real Ray server: ``nox -s e2e-ray`` (tests/e2e/test_ray.py).
"""

from __future__ import annotations

import functools
import logging
import pickle

import cloudpickle
import pytest
import vllm.v1.engine.core as core_module
from vllm.v1.engine.core import DPEngineCoreProc, DPMoEEngineCoreActor, EngineCoreActorMixin
from vllm.v1.engine.utils import CoreEngineActorManager

import vllm_balance
from balance_testbed import factories
from vllm_balance import activation, plugin, registry
from vllm_balance.activation import BalanceConfigError
from vllm_balance.log import LOGGER_NAME
from vllm_balance.ray_actor import BalanceDPMoEEngineCoreActor
from vllm_balance.shim.engine_core import BalanceDPEngineCoreProc

pytestmark = pytest.mark.path_independent

ENABLED = {"enable_balance_scheduling": True}
UPSTREAM_MANAGER_INIT = CoreEngineActorManager.__dict__["__init__"]


@pytest.fixture(autouse=True)
def restore_patches():
    yield
    registry.uninstall_all()
    assert core_module.DPMoEEngineCoreActor is DPMoEEngineCoreActor
    assert CoreEngineActorManager.__dict__["__init__"] is UPSTREAM_MANAGER_INIT


def dp_config(moe=True, dp=2, additional_config=ENABLED, **kwargs):
    return factories.make_vllm_config(
        moe=moe, data_parallel_size=dp, additional_config=dict(additional_config), **kwargs
    )


def resolved_actor_class() -> type:
    """What ``CoreEngineActorManager.__init__`` builds for a DP MoE config: its own import."""
    from vllm.v1.engine.core import DPMoEEngineCoreActor as resolved

    return resolved


class UpstreamInitReached(Exception):
    pass


@pytest.fixture
def stop_at_upstream_init(monkeypatch):
    """Upstream's actor ``__init__`` raises at once, recording what it was called with."""
    calls = []

    @functools.wraps(DPMoEEngineCoreActor.__init__)  # its signature, which the actor binds to
    def stop(self, *args, **kwargs):
        calls.append(kwargs)
        raise UpstreamInitReached

    monkeypatch.setattr(DPMoEEngineCoreActor, "__init__", stop)
    return calls


def actor_as_ray_builds_it(config, dp_rank=0):
    """The keyword arguments ``CoreEngineActorManager`` passes to ``.remote()`` (0.27.1-0.33.0)."""
    return BalanceDPMoEEngineCoreActor(
        vllm_config=config,
        executor_class=None,
        log_stats=True,
        local_client=True,
        addresses=None,
        dp_rank=dp_rank,
        local_dp_rank=dp_rank,
    )


def construct_as_ray_does(config, dp_rank=1):
    with pytest.raises(UpstreamInitReached):
        actor_as_ray_builds_it(config, dp_rank)


@pytest.mark.parametrize("ray_installed", [True, False], ids=["ray", "no-ray"])
def test_plugin_wraps_the_api_servers_actor_manager_where_ray_is_installed(
    monkeypatch, ray_installed
):
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "ray":  # the test venvs have no Ray; the e2e-shapes session has
            return real_find_spec("json") if ray_installed else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    registry.uninstall_all()
    plugin.register()
    assert registry.RAY_ACTOR_MANAGER_WRAPPER.is_current() is ray_installed
    wrapped = CoreEngineActorManager.__init__ is activation.balance_actor_manager_init
    assert wrapped is ray_installed


def test_balance_on_the_api_server_resolves_the_balance_actor_class():
    assert activation.choose_ray_actor_class(dp_config()) is True
    assert resolved_actor_class() is BalanceDPMoEEngineCoreActor


@pytest.mark.parametrize(
    "config_kwargs",
    [dict(additional_config={}), dict(moe=False), dict(dp=1)],
    ids=["balance-off", "dense-model", "dp1"],
)
def test_without_effective_balance_the_actor_class_is_upstreams(config_kwargs):
    activation.choose_ray_actor_class(dp_config())
    assert activation.choose_ray_actor_class(dp_config(**config_kwargs)) is False
    assert resolved_actor_class() is DPMoEEngineCoreActor


def test_two_ray_engines_in_one_process_that_disagree_are_refused():
    """The actor class is one name per process, resolved again at each elastic-EP scale-up: a
    second engine whose balance decision differs from a live one's is refused (either would
    start or scale up with the other's class); once the first is gone, it starts."""
    import gc

    first, second = (object.__new__(CoreEngineActorManager) for _ in range(2))
    assert activation.choose_ray_actor_class(dp_config(), first) is True
    with pytest.raises(BalanceConfigError, match="runs with balance scheduling on, this one"):
        activation.choose_ray_actor_class(dp_config(additional_config={}), second)
    assert resolved_actor_class() is BalanceDPMoEEngineCoreActor  # the live engine's, kept
    assert activation.choose_ray_actor_class(dp_config(), second) is True  # agreeing: fine
    del first, second
    gc.collect()
    assert activation.choose_ray_actor_class(dp_config(additional_config={})) is False
    assert resolved_actor_class() is DPMoEEngineCoreActor


def test_a_bad_key_is_refused_in_the_api_server_before_any_actor():
    config = dp_config(additional_config={**ENABLED, "balance_collective": "ring"})
    with pytest.raises(ValueError, match="balance_collective must be one of"):
        activation.choose_ray_actor_class(config)
    assert resolved_actor_class() is DPMoEEngineCoreActor


def test_balance_actor_gathers_after_the_dp_sync_and_keeps_upstreams_init():
    mro = BalanceDPMoEEngineCoreActor.__mro__
    assert mro[1:5] == (
        DPMoEEngineCoreActor,
        EngineCoreActorMixin,
        BalanceDPEngineCoreProc,
        DPEngineCoreProc,
    )
    gather_hook = BalanceDPMoEEngineCoreActor._has_global_unfinished_reqs
    assert gather_hook is BalanceDPEngineCoreProc._has_global_unfinished_reqs


def test_ray_pickles_the_balance_actor_by_reference():
    # Ray ships an actor class with cloudpickle: by reference, each actor imports it from here.
    payload = cloudpickle.dumps(BalanceDPMoEEngineCoreActor)
    assert b"vllm_balance.ray_actor" in payload
    assert pickle.loads(payload) is BalanceDPMoEEngineCoreActor


def test_actor_activates_before_upstreams_init(stop_at_upstream_init, caplog):
    config = dp_config()
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        construct_as_ray_does(config, dp_rank=1)
    assert config.scheduler_config.scheduler_cls is vllm_balance.BalanceScheduler
    assert [kwargs["dp_rank"] for kwargs in stop_at_upstream_init] == [1]
    assert (
        "balance scheduling active: DP1 of DP=2, MoE, path=" in caplog.text
        and "engine core=BalanceDPMoEEngineCoreActor" in caplog.text
    ), caplog.text
    # The mp launcher's swap is not this process's business.
    assert core_module.DPEngineCoreProc is DPEngineCoreProc


def test_actor_whose_config_disagrees_with_the_api_server_refuses(stop_at_upstream_init):
    with pytest.raises(BalanceConfigError, match="chose the balance Ray engine-core actor"):
        actor_as_ray_builds_it(dp_config(additional_config={}))
    assert stop_at_upstream_init == []


def test_actor_hands_vllms_dp_group_to_its_scheduler(monkeypatch):
    """Upstream's actor ``__init__`` calls ``DPEngineCoreProc.__init__`` by name, so
    ``BalanceDPEngineCoreProc.__init__`` never runs, and vLLM assigns the DP group before the
    scheduler exists: without the actor's hand-over every gather is a no-op (seen on a real Ray
    server: 0 of 240 steps frozen). Upstream's order is played with a real gloo group and a real
    balance scheduler."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group
    from vllm.utils.network_utils import get_open_port

    group = stateless_init_torch_distributed_process_group(
        "127.0.0.1", get_open_port(), 0, 1, backend="gloo"
    )
    config = dp_config()

    @functools.wraps(DPMoEEngineCoreActor.__init__)
    def upstream_order(self, vllm_config, *args, **kwargs):
        self.dp_group = group  # _init_data_parallel, before the scheduler is built
        balance_cls = vllm_config.scheduler_config.scheduler_cls  # what activation chose
        self.scheduler = factories.make_scheduler(balance_cls, vllm_config)

    monkeypatch.setattr(DPMoEEngineCoreActor, "__init__", upstream_order)
    actor = actor_as_ray_builds_it(config)
    assert actor.scheduler.balance_gate.group is group
