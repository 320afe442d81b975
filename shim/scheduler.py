"""BalanceScheduler: vLLM's scheduler plus a global admission gate, on the seam.

The engine core calls ``balance_gather()`` once per active step (never ``schedule()``: lessons A
and B in docs/design.md; the gather itself is ``shim/gather.py``); when the largest gathered
``len(self.running)`` **equals** the cap, no rank admits WAITING requests this step. ``==``, not
``>= cap - 1`` (a TTFT regression in vllm-ascend): docs/design.md, "The behaviour contract" and
"The cap".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import SchedulerStats

from vllm_balance.config import read_options
from vllm_balance.shim.gather import RunningCountGather
from vllm_balance.shim.metrics import BalanceMetrics
from vllm_balance.shim.stats import PeriodicLog

if TYPE_CHECKING:  # what the mixin is put in front of, so that super() calls type-check
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object


class BalanceSchedulerMixin(RunningCountGather, _SchedulerBase):
    """Balance state and gate; mixed in front of ``Scheduler`` or ``AsyncScheduler``.

    The gate reads ``balance_queue`` once, when ``schedule()`` starts: whatever the gather (or a
    test, or the simulator through ``set_gathered()``) put there last.
    """

    # Upstream attributes the gate reads, on every supported release (test_upstream_surface.py).
    max_num_running_reqs: int
    prefill_capacity_bound: bool
    if TYPE_CHECKING:

        def get_request_counts(self) -> tuple[int, int]: ...

    def __init__(self, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        options = read_options(vllm_config)  # None: balance off
        self._balance_enabled = options is not None
        self._balance_metrics: BalanceMetrics | None = None
        self.dp_group: Any = None
        self.admission_frozen = False
        self.admission_deferred = False  # this step's gate stopped a fresh admission
        if options is not None:
            # Feature detection, not a version: the admission limit the WAITING loop stops at.
            self.balance_cap: int = getattr(self, "max_num_active_reqs", self.max_num_running_reqs)
            self._balance_metrics = BalanceMetrics()
            self._periodic_log = PeriodicLog(options.log_interval_s, self._balance_metrics)
            self._init_gather(options, vllm_config.parallel_config)

    def leader_at_cap(self) -> bool:
        """Contract 1: some rank was at the cap at the end of the previous step."""
        return int(self.gathered_vector().max()) == self.balance_cap

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        if self._balance_enabled:
            frozen = self.leader_at_cap()
            released = frozen and self._release_next_step
            self.admission_frozen = frozen and not released
            # Upstream's own count: its waiting queues differ between releases.
            num_waiting = self.get_request_counts()[1] if self.admission_frozen else 0
            self.balance_stats.record_step(
                self.admission_frozen, released, num_waiting, self._dp_rank
            )
            self._periodic_log.maybe_log(self.balance_stats, self._dp_rank)
            if self.admission_frozen:
                return self._held_schedule(throttle_prefills)
        return super().schedule(throttle_prefills)

    def _held_schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        """A frozen step: upstream's, but a step the gate held records nothing for vLLM's prefill
        cadence (a hold is policy, not capacity: docs/design.md, Phase 2B, "a hold is not a
        capacity limit")."""
        capacity_bound = self.prefill_capacity_bound
        output, self.admission_deferred = self._hold_and_schedule(throttle_prefills)
        if self.admission_deferred:
            self.prefill_capacity_bound = capacity_bound
        return output

    def _hold_and_schedule(self, throttle_prefills: bool) -> tuple[SchedulerOutput, bool]:
        """Upstream's step under this path's hold, and whether the hold stopped an admission.

        Here the seam (or a gate inlined where the seam is called) holds and records it; a path
        that holds another way (the pause-state hold) overrides this."""
        self.admission_deferred = False
        output = self._upstream_schedule(throttle_prefills)
        return output, self.admission_deferred

    def _upstream_schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        return super().schedule(throttle_prefills)

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        """Upstream's stats; after a publish, carrying its counters to the API server
        (shim/metrics.py). Arguments as upstream's, whose signature differs between releases."""
        stats = super().make_stats(*args, **kwargs)
        metrics = self._balance_metrics
        if metrics is None or not metrics.pending or stats is None:
            return stats
        return metrics.attach(stats)

    def _should_stop_admitting_waiting(self) -> bool:
        """The seam: called after upstream's own slot check, before a fresh request (0.31+:
        KV-holders drain first); records that the gate stopped one (docs/design.md, Phase 2B)."""
        if self.admission_frozen:
            self.admission_deferred = True
        return self.admission_frozen


class BalanceScheduler(BalanceSchedulerMixin, Scheduler):
    """Balance on top of the synchronous ``Scheduler`` (needs the seam)."""


class BalanceAsyncScheduler(BalanceSchedulerMixin, AsyncScheduler):
    """Balance on top of ``AsyncScheduler``, which vLLM builds when async scheduling is on."""
