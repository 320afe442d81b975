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

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_balance.ascend import takeover
from vllm_balance.config import (
    ENABLE_KEY,
    BalanceConfigError,
    BalanceOptions,
    balance_mentioned,
    read_options,
)
from vllm_balance.log import logger
from vllm_balance.registry import (
    DP_ENGINE_CORE_SWAP,
    RAY_ACTOR_MANAGER_WRAPPER,
    RAY_ACTOR_SWAP,
    RUN_ENGINE_CORE_WRAPPER,
)

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig


@dataclass(frozen=True)
class BalanceDecision:
    """Whether balance is activated in one engine process, and why (``balance_applies``)."""

    enabled: bool  # the config enables balance scheduling
    reason: str  # why it is (or is not) activated; a warning where enabled but not activated
    options: BalanceOptions | None = None  # set exactly when it is activated
    foreign: tuple[str, ...] = ()  # vllm-ascend's balance patches found (take-over mode)

    @property
    def active(self) -> bool:
        return self.options is not None


NOT_REQUESTED = BalanceDecision(False, "nothing in the config asks for balance scheduling")


def _kv_role(vllm_config: VllmConfig) -> str | None:
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    return getattr(kv_transfer_config, "kv_role", None) if kv_transfer_config else None


def balance_applies(
    vllm_config: VllmConfig, options: BalanceOptions | None, foreign: list[str]
) -> BalanceDecision:
    """The decision for this engine process, from the config, its options (``read_options``)
    and vllm-ascend's balance patches found in the process (``prepare_vllm_ascend``); raises on
    impossible configs. Reads, never changes: ``decide()`` runs the steps before it.

    Its reasons and errors are the operator-facing validation table of docs/operations.md.
    """
    if options is None:
        return BalanceDecision(False, f"{ENABLE_KEY} is not true in this config")
    parallel_config = vllm_config.parallel_config
    # Refusals only where balance could act: elsewhere it installs nothing, so nothing conflicts.
    if parallel_config.data_parallel_size <= 1:
        return BalanceDecision(
            True,
            "balance scheduling is enabled but data_parallel_size="
            f"{parallel_config.data_parallel_size}: it has no effect without data parallelism; "
            "nothing is installed",
        )
    if not vllm_config.model_config.is_moe:
        return BalanceDecision(
            True,
            "balance scheduling is enabled but the model is not MoE: vLLM runs dense DP ranks "
            "as independent engines with no cross-rank sync, so balance cannot act; "
            "nothing is installed",
        )
    role = _kv_role(vllm_config)
    if role in ("kv_producer", "kv_consumer"):
        raise BalanceConfigError(
            "balance scheduling supports PD-mixed mode only; kv_transfer_config.kv_role="
            f"{role!r} (PD-disaggregated) cannot enable {ENABLE_KEY}"
        )
    steps_aside = takeover.next_to_vllm_ascend(vllm_config, options, foreign)
    if steps_aside is not None:
        return BalanceDecision(True, steps_aside)
    refusal = fault_tolerance_refusal(parallel_config)
    if refusal is not None:
        raise BalanceConfigError(refusal)
    reason = f"DP={parallel_config.data_parallel_size}, MoE, PD-mixed"
    return BalanceDecision(True, reason, options, tuple(foreign))


def decide(vllm_config: VllmConfig | None) -> BalanceDecision:
    """This process's decision, in the one order that is right; logs why not where balance is
    enabled but cannot act.

    1. ``balance_mentioned``: a read that imports and initialises nothing; balance off stops here
       (nothing imported, initialised, read further or swapped).
    2. ``prepare_vllm_ascend``: vllm-ascend's side effects (its platform patches, its
       ``AscendConfig``), before the config is read: ``read_options`` reads the enable key from
       ``AscendConfig`` first, which answers only once initialised; read earlier, it would see
       ``additional_config`` where vllm-ascend sees its own parsed value.
    3. ``read_options``, then ``balance_applies``: the options (a bad key is an error wherever
       balance is asked for) and the pure decision.
    """
    if vllm_config is None or not balance_mentioned(vllm_config):
        return NOT_REQUESTED
    foreign = takeover.prepare_vllm_ascend(vllm_config)
    decision = balance_applies(vllm_config, read_options(vllm_config), foreign)
    if decision.enabled and not decision.active:
        logger.warning("%s", decision.reason)
    return decision


FAULT_TOLERANCE_NOT_ROUTED = (
    "balance scheduling cannot run with this vLLM's fault tolerance (--enable-fault-tolerance): "
    "its DP engine core's busy loop (DPEngineCoreProc.run_busy_loop) is not wrapped by "
    "fault_tolerant_wrapper, so a balance gather that fails on a peer's fault would not reach "
    "vLLM's recovery; turn off one of enable_balance_scheduling and --enable-fault-tolerance"
)
FAULT_TOLERANCE_NO_TIMEOUT = (
    "balance scheduling cannot run with vLLM's fault tolerance (--enable-fault-tolerance) and "
    "{source}: no positive timeout bounds balance's per-step gather, so after a rank's fault the "
    "healthy ranks would wait in it instead of reaching vLLM's recovery; set it above 0, or turn "
    "off one of enable_balance_scheduling and --enable-fault-tolerance"
)


def fault_tolerance_refusal(parallel_config: ParallelConfig) -> str | None:
    """Why balance cannot run under this vLLM's fault tolerance; None where it can, or it is off.

    Balance runs with it where a gather blocked by a faulted peer becomes the healthy rank's own
    fault in vLLM's terms: the gather fails after a positive timeout
    (``gather_timeout_under_fault_tolerance``) and the exception leaves the DP busy loop through
    ``fault_tolerant_wrapper`` (feature detection: the wrapper exists and wraps the loop).
    """
    from vllm_balance.shim.gather import gather_timeout_under_fault_tolerance

    timeout = gather_timeout_under_fault_tolerance(parallel_config)
    if timeout is None:
        return None
    if not timeout.seconds > 0:
        return FAULT_TOLERANCE_NO_TIMEOUT.format(source=timeout.source)
    try:  # vLLM 0.30+
        from vllm.v1.fault_tolerance.engine_core_sentinel import fault_tolerant_wrapper
    except ImportError:
        return FAULT_TOLERANCE_NOT_ROUTED
    from vllm.v1.engine.core import DPEngineCoreProc

    # The wrapper returns its inner function, unrenamed: the loop's qualified name says it.
    wrapper_locals = f"{fault_tolerant_wrapper.__qualname__}.<locals>."
    if not DPEngineCoreProc.run_busy_loop.__qualname__.startswith(wrapper_locals):
        return FAULT_TOLERANCE_NOT_ROUTED
    return None


def select_scheduler_cls(vllm_config: VllmConfig) -> type:
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
    vllm_config: VllmConfig | None,
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
    decision = decide(vllm_config)
    if decision.options is None:
        if engine_core is None:
            DP_ENGINE_CORE_SWAP.uninstall()
        return False
    assert vllm_config is not None  # decided active on it
    takeover.take_over_if_requested(decision.options, list(decision.foreign))
    scheduler_cls = select_scheduler_cls(vllm_config)
    if engine_core is None:
        DP_ENGINE_CORE_SWAP.install()
        # What run_engine_core will build (the swapped module-global), not a fixed name.
        engine_core = DP_ENGINE_CORE_SWAP.current()
    from vllm_balance.selection import active_path
    from vllm_balance.shim.gather import gather_timeout_under_fault_tolerance

    parallel_config = vllm_config.parallel_config
    timeout = gather_timeout_under_fault_tolerance(parallel_config)
    logger.info(
        "balance scheduling active: DP%d of DP=%d, MoE, path=%s, scheduler=%s, engine core=%s%s",
        parallel_config.data_parallel_rank if dp_rank is None else dp_rank,
        parallel_config.data_parallel_size,
        active_path(),
        scheduler_cls.__name__,
        engine_core.__name__,
        ""
        if timeout is None
        else f", fault tolerance: gather timeout {timeout.seconds:g} s ({timeout.source})",
    )
    from vllm_balance.shim.metrics import export_status

    logger.info("%s", export_status(log_stats))
    return True


def balance_run_engine_core(*args: Any, dp_rank: int = 0, local_dp_rank: int = 0, **kwargs: Any):
    """Replacement for ``EngineCoreProc.run_engine_core``: decide, then run upstream's."""
    activate_for(kwargs.get("vllm_config"), kwargs.get("log_stats"), dp_rank)
    upstream = RUN_ENGINE_CORE_WRAPPER.upstream()
    return upstream(*args, dp_rank=dp_rank, local_dp_rank=local_dp_rank, **kwargs)


# The Ray engine managers alive in this process, by whether balance applies to them.
_ray_managers: dict[bool, weakref.WeakSet] = {True: weakref.WeakSet(), False: weakref.WeakSet()}


def choose_ray_actor_class(vllm_config: VllmConfig, manager: Any = None) -> bool:
    """The API server's decision for Ray engine-core actors; returns whether balance applies.

    With Ray, vLLM's ``CoreEngineActorManager`` (in the API server) resolves
    ``vllm.v1.engine.core.DPMoEEngineCoreActor`` by module-global name and Ray builds that class
    in each actor: ``run_engine_core`` never runs there, so the class must be chosen here, from
    the same config the actors get (each actor's ``__init__`` then activates, as
    ``run_engine_core``'s wrapper does: ``vllm_balance.shim.engine_core``). Bad keys and
    impossible configs are refused here, before any actor starts.

    The name is one per process and vLLM resolves it again at each elastic-EP scale-up, so a
    second Ray engine (``manager``) that disagrees with one still alive in this process is
    refused: either would otherwise start or scale up with the other's class.
    """
    applies = decide(vllm_config).active
    if _ray_managers[not applies]:
        raise BalanceConfigError(
            "balance scheduling: another Ray data-parallel engine in this process runs with "
            f"balance scheduling {'off' if applies else 'on'}, this one with it "
            f"{'on' if applies else 'off'}; the Ray engine-core actor class is one per process "
            "(vllm.v1.engine.core.DPMoEEngineCoreActor, resolved again at each elastic-EP "
            "scale-up): run engines that differ in balance scheduling in separate processes"
        )
    (RAY_ACTOR_SWAP.install if applies else RAY_ACTOR_SWAP.uninstall)()
    if manager is not None:
        _ray_managers[applies].add(manager)
    return applies


def balance_actor_manager_init(
    manager: Any, vllm_config: VllmConfig, *args: Any, **kwargs: Any
) -> None:
    """Replacement for ``CoreEngineActorManager.__init__``: decide, then run upstream's."""
    choose_ray_actor_class(vllm_config, manager)
    RAY_ACTOR_MANAGER_WRAPPER.upstream()(manager, vllm_config, *args, **kwargs)
