"""BalanceScheduler: vLLM's scheduler plus a global admission gate, on the seam.

The engine core calls ``balance_gather()`` once per active step (never ``schedule()``: lessons A
and B in docs/design.md); when the largest gathered ``len(self.running)`` **equals** the cap, no
rank admits WAITING requests this step. ``==``, not ``>= cap - 1`` (a TTFT regression in
vllm-ascend): docs/design.md, "The behaviour contract" and "The cap".
"""

from __future__ import annotations

import operator
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import SchedulerStats

from vllm_balance.config import ALL_GATHER, read_options
from vllm_balance.shim import collective
from vllm_balance.shim.metrics import BalanceMetrics
from vllm_balance.shim.stats import BalanceStats, PeriodicLog
from vllm_balance.shim.watchdog import GatherWatchdog

try:  # pause_scheduler(mode="keep"); feature detection, not a version
    from vllm.v1.core.sched.interface import PauseState

    PAUSED_ALL: Any = PauseState.PAUSED_ALL
except ImportError:  # a vLLM without scheduler pause states
    PAUSED_ALL = None


if TYPE_CHECKING:  # what the mixin is put in front of, so that super() calls type-check
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object


class BalanceSchedulerMixin(_SchedulerBase):
    """Balance state and gate; mixed in front of ``Scheduler`` or ``AsyncScheduler``.

    The gate reads ``balance_queue`` once, when ``schedule()`` starts: whatever the gather (or a
    test, or the simulator through ``set_gathered()``) put there last.
    """

    # Upstream attributes the mixin reads, on every supported release (test_upstream_surface.py).
    running: list
    max_num_running_reqs: int
    pause_state: Any  # where PAUSED_ALL exists
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
        self.admission_held = False  # this step's gate stopped a fresh admission
        if options is not None:
            parallel_config = vllm_config.parallel_config
            self._all_gather = options.collective == ALL_GATHER
            self.balance_stats = BalanceStats()
            # Feature detection, not a version: the admission limit the WAITING loop stops at.
            self.balance_cap: int = getattr(self, "max_num_active_reqs", self.max_num_running_reqs)
            self._balance_metrics = BalanceMetrics()
            self._periodic_log = PeriodicLog(options.log_interval_s, self._balance_metrics)
            self._max_frozen_steps = options.max_frozen_steps
            self._gather_watchdog = GatherWatchdog(
                options.gather_warn_s,
                parallel_config.data_parallel_rank,
                parallel_config.data_parallel_size,
                self.balance_stats,
            )
            # The group the buffer is sized for; until one is handed over, the config's size
            # (the simulator and tests fill the buffer without a group).
            self._gather_group: Any = None
            self._reset_gathered(
                parallel_config.data_parallel_size, parallel_config.data_parallel_rank
            )

    def _reset_gathered(self, dp_size: int, dp_rank: int) -> None:
        """A zeroed buffer for ``dp_size`` ranks, and the state counted from gathered vectors.

        The first step on a new DP group is decided as the first step after start-up: open on
        every rank, as no count has been gathered on that group yet (docs/design.md, "When the
        DP group changes, pauses or faults").
        """
        self._dp_size, self._dp_rank = dp_size, dp_rank
        # [1]-shaped views of one buffer: the gate reads every rank's count in one max().
        self._gathered = torch.zeros(dp_size if self._all_gather else 1, dtype=torch.int32)
        self.balance_queue = list(self._gathered.split(1))
        self._gathered_views = tuple(self.balance_queue)
        self._frozen_streak = 0
        self._release_next_step = False
        self.balance_stats.last_gathered = []
        self._gather_watchdog.follow(dp_rank, dp_size)

    def follow_dp_group(self, group: Any) -> None:
        """Gather on ``group`` from now on, sized and ranked by it.

        vLLM replaces its DP group object, with a new size and rank, on an elastic-EP resize
        (``ElasticEPScalingState._commit_new_dp_group``) and keeps the scheduler; the engine core
        hands each group over as vLLM assigns it, so the next ``schedule()`` already reads a
        buffer of the new group (``BalanceDPEngineCoreProc.dp_group``).
        """
        self.dp_group = group
        if self._balance_enabled and group is not None and group is not self._gather_group:
            self._gather_group = group
            self._reset_gathered(group.size(), group.rank())

    def balance_gather(self) -> None:
        """All-gather ``len(self.running)`` into ``balance_queue``; no-op when disabled/no group.

        The watchdog reports a gather a peer never enters (docs/operations.md, "A blocked gather").
        A rank paused with ``mode="keep"`` contributes 0, as vLLM's own DP sync counts it
        (``get_num_unfinished_requests()`` is 0 under ``PAUSED_ALL``): it schedules no token, so
        its full slots must not freeze the ranks that run.
        """
        if not self._balance_enabled or self.dp_group is None:
            return
        if self.dp_group is not self._gather_group:  # set directly, not through follow_dp_group
            self.follow_dp_group(self.dp_group)
        watchdog = self._gather_watchdog
        if watchdog.unstarted:
            watchdog.start_for(self)
        reduced = None
        running = len(self.running)
        if running and PAUSED_ALL is not None and self.pause_state == PAUSED_ALL:
            running = 0  # paused with mode="keep": it runs nothing
        watchdog.started = started = time.monotonic()
        try:
            if self._all_gather:
                running_count = torch.tensor([running], dtype=torch.int32)
                dist.all_gather(self.balance_queue, running_count, group=self.dp_group)
            else:
                reduced = collective.reduce_running(running, self.dp_group)
                self.set_gathered([reduced.maximum])
        finally:
            watchdog.started = None
        self.balance_stats.gather_seconds += time.monotonic() - started
        self.observe_gathered(reduced)

    def set_gathered(self, counts: list[int] | torch.Tensor) -> None:
        """Write gathered counts (or the reduction's maximum alone) where the gate reads them."""
        self._gathered.copy_(torch.as_tensor(counts, dtype=torch.int32))
        self.balance_queue = list(self._gathered_views)

    def observe_gathered(self, reduced: collective.Reduced | None = None) -> None:
        """Stats and the bounded hold's streak, after each gather (the sim calls it too).

        The streak is counted here, where every rank sees the same data, not in ``schedule()``,
        which a drained rank never enters (lesson A).
        """
        if reduced is None:
            self.balance_stats.record_gather(self.gathered_vector().tolist())
        else:
            self.balance_stats.record_reduced(*reduced, self._dp_size)
        if self._max_frozen_steps is not None:
            at_cap = self.leader_at_cap()
            self._frozen_streak = self._frozen_streak + 1 if at_cap else 0
            self._release_next_step = self._frozen_streak > self._max_frozen_steps
            if self._release_next_step:
                self._frozen_streak = 0

    def gathered_vector(self) -> torch.Tensor:
        """``balance_queue`` as one tensor: the buffer itself while it holds the buffer's views
        (free), else a concatenation of what was put there (~1,300 instructions at DP=256)."""
        queue, views = self.balance_queue, self._gathered_views
        if len(queue) == len(views) and all(map(operator.is_, queue, views)):
            return self._gathered
        return torch.cat(queue)

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
        self.admission_held = False
        capacity_bound = self.prefill_capacity_bound
        output = super().schedule(throttle_prefills)
        if self.admission_held:
            self.prefill_capacity_bound = capacity_bound
        return output

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
            self.admission_held = True
        return self.admission_frozen


class BalanceScheduler(BalanceSchedulerMixin, Scheduler):
    """Balance on top of the synchronous ``Scheduler`` (needs the seam)."""


class BalanceAsyncScheduler(BalanceSchedulerMixin, AsyncScheduler):
    """Balance on top of ``AsyncScheduler``, which vLLM builds when async scheduling is on."""
