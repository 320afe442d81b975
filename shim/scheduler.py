"""BalanceScheduler: vLLM's scheduler plus a global admission gate, on the seam.

The whole feature is two operations:
- ``balance_gather()``: every active engine step, all-gather ``len(self.running)`` across the
  DP group into ``balance_queue`` (triggered by the engine core, never from ``schedule()``;
  see ``vllm_balance.shim.engine_core``);
- the gate: when the largest gathered count **equals** the cap (``balance_cap``), no rank admits
  WAITING requests this step.

With the opt-in ``balance_collective: "recursive_doubling"`` the gather is a log-depth reduction
(``vllm_balance.shim.collective``) at the same place, and ``balance_queue`` holds one entry, the
largest count: all the gate reads, so the decision is the same.

NOTE(contract 1): ``==`` against the limit at which upstream's own WAITING loop stops admitting
(``max_num_active_reqs`` on 0.31+, else ``max_num_running_reqs``); not ``>= cap - 1`` (shipped
once in vllm-ascend, reverted for a TTFT regression), not "catch up to the leader"
(docs/design.md, "The behaviour contract" and "The cap").
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

from vllm_balance.config import ALL_GATHER, options_for
from vllm_balance.shim import collective
from vllm_balance.shim.metrics import BalanceMetrics
from vllm_balance.shim.stats import BalanceStats, PeriodicLog
from vllm_balance.shim.watchdog import GatherWatchdog


class BalanceSchedulerMixin:
    """Balance state and gate; mixed in front of ``Scheduler`` or ``AsyncScheduler``.

    ``balance_queue`` is the public state the gate reads: the engine core's gather writes it,
    and tests and tools may set it directly (``set_gathered()`` writes the gather's buffer, as
    the simulator does; a list put there is read as it is). The gate value is therefore derived
    from it when ``schedule()`` starts (once per step: it cannot change during one
    ``schedule()``), not when the gather runs, and not once per WAITING-loop iteration.

    The opt-in bounded hold (``balance_max_frozen_steps``) counts frozen steps where every rank
    sees the same data, in ``observe_gathered()`` after each gather: a drained rank never enters
    ``schedule()`` (lesson A), so a count kept there would drift apart across ranks.
    """

    # Declared for type checkers: the scheduler attributes the mixin relies on. Each one exists on
    # every release the support matrix lists (tests/test_upstream_surface.py checks them there);
    # queue attributes that come and go between releases (``skipped_waiting`` is gone in 0.31)
    # are never read here: the waiting count is upstream's own ``get_request_counts()``.
    running: list
    max_num_running_reqs: int
    if TYPE_CHECKING:

        def get_request_counts(self) -> tuple[int, int]: ...

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)  # type: ignore[call-arg]
        options = options_for(vllm_config)  # None: balance off
        self._balance_enabled = options is not None
        # Injected by BalanceDPEngineCoreProc: the gloo DP group exists before the scheduler.
        self.dp_group: Any = None
        self.admission_frozen = False
        if options is not None:
            parallel_config = vllm_config.parallel_config
            # balance_queue holds [1]-shaped views of one int32 buffer: the gather writes every
            # rank's count into the buffer, so the gate reads them all with one reduction. The
            # log-depth reduction writes one entry, the largest count.
            self._dp_size = parallel_config.data_parallel_size
            self._all_gather = options.collective == ALL_GATHER
            self._gathered = torch.zeros(
                self._dp_size if self._all_gather else 1, dtype=torch.int32
            )
            self.balance_queue = list(self._gathered.split(1))
            self._gathered_views = tuple(self.balance_queue)
            self.balance_stats = BalanceStats()
            self._dp_rank = parallel_config.data_parallel_rank
            # Feature detection, not a version: the admission limit the WAITING loop stops at.
            self.balance_cap: int = getattr(self, "max_num_active_reqs", self.max_num_running_reqs)
            metrics = BalanceMetrics(self)  # it hands the counters to vLLM's stats
            self._periodic_log = PeriodicLog(options.log_interval_s, metrics)
            self._max_frozen_steps = options.max_frozen_steps
            self._frozen_streak = 0
            self._release_next_step = False
            # Its thread starts with the first gather: only a scheduler that gathers needs one.
            self._gather_watchdog = GatherWatchdog(
                options.gather_warn_s, self._dp_rank, self._dp_size, self.balance_stats
            )

    def balance_gather(self) -> None:
        """All-gather ``len(self.running)`` into ``balance_queue``; no-op when disabled/no group.

        A gather a peer never enters blocks silently (gloo fails it after 30 min) while the
        server looks healthy; the watchdog reports it, and costs the gather only the timestamp
        written around the all_gather (docs/operations.md, "A blocked gather").
        """
        if not self._balance_enabled or self.dp_group is None:
            return
        watchdog = self._gather_watchdog
        if watchdog.unstarted:
            watchdog.start_for(self)
        reduced = None
        watchdog.started = started = time.monotonic()
        try:
            if self._all_gather:
                running_count = torch.tensor([len(self.running)], dtype=torch.int32)
                dist.all_gather(self.balance_queue, running_count, group=self.dp_group)
            else:
                reduced = collective.reduce_running(len(self.running), self.dp_group)
                self.set_gathered([reduced.maximum])
        finally:
            watchdog.started = None
        self.balance_stats.gather_seconds += time.monotonic() - started
        self.observe_gathered(reduced)

    def set_gathered(self, counts: list[int] | torch.Tensor) -> None:
        """Put what a gather delivers (every rank's count; the log-depth reduction's largest
        count alone) where the gate reads it: the buffer, whose views ``balance_queue`` holds."""
        self._gathered.copy_(torch.as_tensor(counts, dtype=torch.int32))
        self.balance_queue = list(self._gathered_views)

    def observe_gathered(self, reduced: collective.Reduced | None = None) -> None:
        """Account for a freshly gathered ``balance_queue`` (called by the gather and the sim).

        ``reduced``: the log-depth reduction's result, where no per-rank counts exist.
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
        """``balance_queue`` as one tensor.

        The gather's buffer while ``balance_queue`` still holds its views (the all_gather and
        ``set_gathered()`` write into them in place), else the concatenation of whatever a test
        or tool put there. The buffer costs nothing at any DP; concatenating costs ~1,300
        instructions per rank, 1% of an admission-heavy ``schedule()`` at DP=256.
        """
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
            # Upstream's own count (its waiting queues differ between releases); read only when
            # it is recorded.
            num_waiting = self.get_request_counts()[1] if self.admission_frozen else 0
            self.balance_stats.record_step(
                self.admission_frozen, released, num_waiting, self._dp_rank
            )
            self._periodic_log.maybe_log(self.balance_stats, self._dp_rank)
        return super().schedule(throttle_prefills)  # type: ignore[misc]

    def _should_stop_admitting_waiting(self) -> bool:
        """The seam: hold-only, so upstream's own slot check has run inline already and this
        can only hold back (docs/design.md, Phase 2B)."""
        return self.admission_frozen


class BalanceScheduler(BalanceSchedulerMixin, Scheduler):
    """Balance on top of the synchronous ``Scheduler`` (needs the seam)."""


class BalanceAsyncScheduler(BalanceSchedulerMixin, AsyncScheduler):
    """Balance on top of ``AsyncScheduler``, which vLLM builds when async scheduling is on."""
