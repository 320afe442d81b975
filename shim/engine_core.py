"""The DP engine core's part of balance scheduling: when to gather, once per active step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from vllm.v1.engine.core import DPEngineCoreProc

from vllm_balance.log import release_held_records

if TYPE_CHECKING:
    from vllm_balance.shim.scheduler import BalanceSchedulerMixin


class BalanceDPEngineCoreProc(DPEngineCoreProc):
    """``DPEngineCoreProc`` that says when the scheduler gathers, and on which DP group.

    The gather is triggered from ``_has_global_unfinished_reqs``, after upstream's. Not because
    the ranks have just agreed there: vLLM syncs ``engines_running`` only on a wave's first step
    and every ``dp_sync_interval`` steps, returning True in between. Because ``run_busy_loop``
    calls it exactly once per iteration on every rank while any rank runs (``engines_running``
    is the same on every rank: the last agreed value, or True between syncs), after the step's
    forward, which the MoE collectives lock-step; all ranks skip it together only when the agreed
    value says all are idle. The scheduler does the gather (it owns the counts, the gate and the
    watchdog); the engine core only says when, as vLLM's own DP policy, the prefill cadence, is
    decided here and applied in ``schedule()``. Inside ``schedule()`` (lesson A) or
    ``_process_engine_step()`` (lesson B) it deadlocked in production (docs/design.md, "Where the
    gather sits, and the two deadlocks").
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM configured logging in this process just before (0.31+): the activation's lines.
        release_held_records()
        super().__init__(*args, **kwargs)
        self.balance_scheduler.follow_dp_group(self.dp_group)

    @property
    def balance_scheduler(self) -> BalanceSchedulerMixin:
        """The scheduler: activation builds a balance scheduler for every engine of this class."""
        return cast("BalanceSchedulerMixin", self.scheduler)

    @property
    def dp_group(self) -> Any:
        """vLLM's DP group. vLLM assigns it at start-up (before the scheduler exists) and again
        when it swaps in a new group, keeping the scheduler: an elastic-EP resize
        (``ElasticEPScalingState._commit_new_dp_group``) and a fault-tolerance ``retry``
        (``EngineCoreSentinel``'s group re-init, on the input thread while the busy loop waits
        in ``fault_tolerant_wrapper``). Each assignment is handed to the scheduler at once, so
        the step after either gathers and decides on the new group."""
        return self._balance_dp_group

    @dp_group.setter
    def dp_group(self, group: Any) -> None:
        self._balance_dp_group = group
        scheduler = getattr(self, "scheduler", None)  # None inside _init_data_parallel
        if scheduler is not None:
            scheduler.follow_dp_group(group)

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        result = super()._has_global_unfinished_reqs(local_unfinished)
        self.balance_scheduler.balance_gather()
        return result
