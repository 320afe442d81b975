"""Conditional activation in the engine-core process.

``EngineCoreProc.run_engine_core`` (the target vLLM's launcher starts in every engine-core
process) resolves ``DPEngineCoreProc`` by module-global name at call time and builds the
scheduler from ``scheduler_config.get_scheduler_cls()``. The wrapper below runs first, with the
process's ``VllmConfig`` in hand, and decides for this process only:

- balance on (DP > 1, MoE, PD-mixed): ``vllm.v1.engine.core.DPEngineCoreProc`` becomes
  ``BalanceDPEngineCoreProc`` and the scheduler class becomes the balance counterpart of the one
  vLLM would build (``Scheduler`` or ``AsyncScheduler``);
- anything else: the upstream ``DPEngineCoreProc`` is restored and the config is not touched.

With ``--data-parallel-backend ray`` no engine core runs ``run_engine_core``: the API server
chooses the actors' class (``choose_ray_actor_class``) and each actor calls ``activate_for``
itself (``vllm_balance.ray_actor``).

NOTE(load-bearing): if upstream ever binds ``DPEngineCoreProc`` at import time (or moves the
construction out of ``run_engine_core``), the swap silently stops working;
``tests/test_activation.py`` checks it by behaviour.
"""

from __future__ import annotations

from typing import Any

from vllm_balance import registry
from vllm_balance.config import (
    ENABLE_KEY,
    TAKE_OVER_ENV_VAR,
    TAKE_OVER_KEY,
    BalanceOptions,
    balance_requested,
    read_options,
)
from vllm_balance.log import logger
from vllm_balance.registry import (
    DP_ENGINE_CORE_SWAP,
    RAY_ACTOR_MANAGER_WRAPPER,
    RAY_ACTOR_SWAP,
    RUN_ENGINE_CORE_WRAPPER,
)
from vllm_balance.takeover import (
    import_vllm_ascend_patches,
    init_vllm_ascend_config,
    is_vllm_ascend,
    take_over,
)


class BalanceConfigError(ValueError):
    """A configuration that enables balance scheduling but cannot honour it."""


def _kv_role(vllm_config: Any) -> str | None:
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    return getattr(kv_transfer_config, "kv_role", None) if kv_transfer_config else None


def _foreign_balance_patches() -> list[str]:
    """Upstream names that another package (vllm-ascend's own balance patch, DyntraLB) replaced.

    vllm-ascend's built-in balance scheduling swaps the module-level ``Scheduler`` and wraps
    ``run_engine_core`` (its DyntraLB patches the same places); two balance gates would gather
    twice per step and disagree on the freeze. For ``run_engine_core`` what counts is what our
    wrapper calls after deciding (a vllm-ascend wrapper there would swap ``DPEngineCoreProc``
    behind our back; the first function below ours, no walk through another package's private
    globals); a wrapper that called ours has already run, and what it swapped shows in the two
    class names.
    """
    import vllm.v1.core.sched.scheduler as scheduler_module
    import vllm.v1.engine.core as core_module

    candidates = {
        "vllm.v1.core.sched.scheduler.Scheduler": scheduler_module.Scheduler,
        "vllm.v1.engine.core.DPEngineCoreProc": core_module.DPEngineCoreProc,
        "EngineCoreProc.run_engine_core": RUN_ENGINE_CORE_WRAPPER.upstream(),
    }
    return [
        f"{name} -> {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
        for name, obj in candidates.items()
        if is_vllm_ascend(obj)
    ]


def balance_applies(vllm_config: Any) -> tuple[BalanceOptions, list[str]] | None:
    """(options, foreign patches) where balance must be activated for this engine process, else
    None; raises on impossible configs.

    Warnings (balance requested but it cannot act, so nothing is installed) and errors are the
    operator-facing validation table of docs/operations.md.
    """
    if vllm_config is None or not balance_requested(vllm_config):
        return None  # balance off: nothing imported, initialised, read further or swapped
    import_vllm_ascend_patches()  # wherever plugin order put them: check the final state
    foreign = _foreign_balance_patches()
    if foreign:  # vllm-ascend's own code initialises it in this process, whichever decides
        init_vllm_ascend_config(vllm_config)
    options = read_options(vllm_config)  # a bad key is an error wherever balance is asked for
    if options is None:
        return None
    parallel_config = vllm_config.parallel_config
    # Refusals only where balance could act: elsewhere it installs nothing, so nothing conflicts.
    if parallel_config.data_parallel_size <= 1:
        logger.warning(
            "balance scheduling is enabled but data_parallel_size=%d: it has no effect "
            "without data parallelism; nothing is installed",
            parallel_config.data_parallel_size,
        )
        return None
    if not vllm_config.model_config.is_moe:
        logger.warning(
            "balance scheduling is enabled but the model is not MoE: vLLM runs dense DP ranks "
            "as independent engines with no cross-rank sync, so balance cannot act; "
            "nothing is installed"
        )
        return None
    role = _kv_role(vllm_config)
    if role in ("kv_producer", "kv_consumer"):
        raise BalanceConfigError(
            "balance scheduling supports PD-mixed mode only; kv_transfer_config.kv_role="
            f"{role!r} (PD-disaggregated) cannot enable {ENABLE_KEY}"
        )
    if foreign and not options.take_over_vllm_ascend:
        raise BalanceConfigError(
            "balance scheduling is already patched in by vllm-ascend ("
            + "; ".join(foreign)
            + f"): refusing a second activation. Set {TAKE_OVER_ENV_VAR}=1 (or additional_config."
            f"{TAKE_OVER_KEY}=true where vllm-ascend accepts the key) to restore vLLM's names and "
            "run vllm-balance-scheduling instead (docs/operations.md, 'With vllm-ascend on "
            "Ascend'), or do not install vllm-balance-scheduling with this vllm-ascend"
        )
    if getattr(parallel_config, "enable_fault_tolerance", False):
        raise BalanceConfigError(FAULT_TOLERANCE_REFUSAL)
    return options, foreign


# Why not followed: docs/design.md, "When the DP group changes, pauses or faults".
FAULT_TOLERANCE_REFUSAL = (
    "balance scheduling cannot run with vLLM's fault tolerance (--enable-fault-tolerance): after "
    "a rank's fault the healthy ranks would wait in balance's per-step gather instead of "
    "reaching vLLM's recovery; turn off one of enable_balance_scheduling and "
    "--enable-fault-tolerance"
)


def select_scheduler_cls(vllm_config: Any) -> type:
    """Set the balance scheduler class on this process's config; returns it.

    A user-set ``scheduler_cls`` is kept only if it is already balance-aware: silently replacing
    it, or silently running it without the gate, would both surprise the operator.
    """
    from vllm_balance.selection import balance_counterpart
    from vllm_balance.shim.scheduler import BalanceSchedulerMixin

    scheduler_config = vllm_config.scheduler_config
    if scheduler_config.scheduler_cls is not None:
        user_cls = scheduler_config.get_scheduler_cls()
        if isinstance(user_cls, type) and issubclass(user_cls, BalanceSchedulerMixin):
            return user_cls
        raise BalanceConfigError(
            f"balance scheduling needs its own scheduler, but scheduler_cls={user_cls!r} is set. "
            "Either unset scheduler_cls, or derive your scheduler from "
            "vllm_balance.shim.scheduler.BalanceSchedulerMixin (put it first in the bases) "
            "and set that class"
        )
    upstream_cls = scheduler_config.get_scheduler_cls()
    balance_cls = balance_counterpart(upstream_cls)
    if balance_cls is None:
        raise BalanceConfigError(
            f"balance scheduling has no counterpart for vLLM's scheduler {upstream_cls!r}"
        )
    scheduler_config.scheduler_cls = balance_cls
    return balance_cls


def activate_for(
    vllm_config: Any,
    log_stats: bool | None = None,
    dp_rank: int | None = None,
    engine_core: type | None = None,
) -> bool:
    """Install or remove balance for this engine process; returns whether it is active.

    ``log_stats``: whether this engine core collects vLLM's stats (they carry the metrics).
    ``dp_rank``: this engine's DP rank, for the log line (vLLM sets it in the config only after).
    ``engine_core``: the class already chosen for this process (a Ray actor's, built by the API
    server: see ``RAY_ACTOR_MANAGER_WRAPPER``); None: the ``DPEngineCoreProc`` swap decides it.
    """
    applies = balance_applies(vllm_config)
    if applies is None:
        if engine_core is None:
            DP_ENGINE_CORE_SWAP.uninstall()
        return False
    options, foreign = applies
    _take_over_if_requested(vllm_config, options, foreign)
    scheduler_cls = select_scheduler_cls(vllm_config)
    if engine_core is None:
        DP_ENGINE_CORE_SWAP.install()
        # What run_engine_core will build (the swapped module-global), not a fixed name.
        engine_core = DP_ENGINE_CORE_SWAP.current()
    from vllm_balance.selection import active_path

    parallel_config = vllm_config.parallel_config
    logger.info(
        "balance scheduling active: DP%d of DP=%d, MoE, path=%s, scheduler=%s, engine core=%s",
        parallel_config.data_parallel_rank if dp_rank is None else dp_rank,
        parallel_config.data_parallel_size,
        active_path(),
        scheduler_cls.__name__,
        engine_core.__name__,
    )
    from vllm_balance.shim.metrics import export_status

    logger.info("%s", export_status(log_stats))
    return True


def _take_over_if_requested(vllm_config: Any, options: BalanceOptions, foreign: list[str]) -> None:
    """Take-over mode (vllm_balance.takeover): balance_applies() let foreign patches through."""
    if not foreign:
        if options.take_over_vllm_ascend:
            logger.warning(
                "%s (or %s) is set but vllm-ascend's balance patch is not active in this "
                "process: nothing to take over (remove it)",
                TAKE_OVER_KEY,
                TAKE_OVER_ENV_VAR,
            )
        return
    take_over(vllm_config, foreign)
    left = _foreign_balance_patches()
    if left:
        raise BalanceConfigError(
            "balance scheduling could not take over from vllm-ascend: " + "; ".join(left)
        )


def balance_run_engine_core(*args: Any, dp_rank: int = 0, local_dp_rank: int = 0, **kwargs: Any):
    """Replacement for ``EngineCoreProc.run_engine_core``: decide, then run upstream's."""
    activate_for(kwargs.get("vllm_config"), kwargs.get("log_stats"), dp_rank)
    upstream = RUN_ENGINE_CORE_WRAPPER.upstream()
    return upstream(*args, dp_rank=dp_rank, local_dp_rank=local_dp_rank, **kwargs)


RUN_ENGINE_CORE_WRAPPER.replacement = lambda: registry.static_wrapper(balance_run_engine_core)


def choose_ray_actor_class(vllm_config: Any) -> bool:
    """The API server's decision for Ray engine-core actors; returns whether balance applies.

    With Ray, vLLM's ``CoreEngineActorManager`` (in the API server) resolves
    ``vllm.v1.engine.core.DPMoEEngineCoreActor`` by module-global name and Ray builds that class
    in each actor: ``run_engine_core`` never runs there, so the class must be chosen here, from
    the same config the actors get (each actor's ``__init__`` then activates, as
    ``run_engine_core``'s wrapper does: ``vllm_balance.shim.engine_core``). Bad keys and
    impossible configs are refused here, before any actor starts.
    """
    applies = balance_applies(vllm_config) is not None
    (RAY_ACTOR_SWAP.install if applies else RAY_ACTOR_SWAP.uninstall)()
    return applies


def balance_actor_manager_init(manager: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
    """Replacement for ``CoreEngineActorManager.__init__``: decide, then run upstream's."""
    choose_ray_actor_class(vllm_config)
    RAY_ACTOR_MANAGER_WRAPPER.upstream()(manager, vllm_config, *args, **kwargs)


RAY_ACTOR_MANAGER_WRAPPER.replacement = lambda: balance_actor_manager_init
