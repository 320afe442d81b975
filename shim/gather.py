"""The gather: once per active step, every DP rank all-gathers its ``len(self.running)``.

The scheduler half that moves counts between ranks; the gate that reads them is
``shim/scheduler.py``. The engine core says when (``BalanceDPEngineCoreProc``); the buffer, the
group it is sized for, the pause rule, the watchdog and the gather's statistics live here.

With vLLM's fault tolerance on (``--enable-fault-tolerance``) the gather fails after
``gather_timeout_under_fault_tolerance`` instead of waiting for gloo's own timeout: see there.
"""

from __future__ import annotations

import operator
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from vllm_balance.config import ALL_GATHER, BalanceOptions
from vllm_balance.shim import collective
from vllm_balance.shim.stats import BalanceStats
from vllm_balance.shim.watchdog import GatherWatchdog

try:  # pause_scheduler(mode="keep"); feature detection, not a version
    from vllm.v1.core.sched.interface import PauseState

    PAUSED_ALL: Any = PauseState.PAUSED_ALL
except ImportError:  # a vLLM without scheduler pause states
    PAUSED_ALL = None

if TYPE_CHECKING:
    from vllm.config import ParallelConfig

# The share of vLLM's engine_recovery_timeout_sec a healthy rank may wait in the gather for a
# faulted peer, when cpu_distributed_timeout_seconds does not bound it sooner.
RECOVERY_SHARE = 0.5


class GatherTimeout(NamedTuple):
    """How long a gather may wait for its peers under fault tolerance, and where that comes from."""

    seconds: float
    source: str  # for the activation line: the vLLM setting it is derived from


def gather_timeout_under_fault_tolerance(parallel_config: ParallelConfig) -> GatherTimeout | None:
    """The gather's timeout with vLLM's fault tolerance on; None with it off (gloo's own).

    NOTE(fault tolerance): vLLM's ``fault_tolerant_wrapper`` turns an exception out of the busy
    loop into the rank's fault: ``EngineCoreSentinel.on_fault`` aborts the rank's requests,
    reports it UNHEALTHY, and waits ``engine_recovery_timeout_sec`` for a ``retry``, which only
    UNHEALTHY ranks accept. A faulted peer never enters the gather, so without a bound the healthy
    ranks would wait in it for gloo's timeout (30 min by default), stay HEALTHY, and the faulted
    rank would give up first. Bounded, the gather raises out of ``_has_global_unfinished_reqs``
    into the wrapper: the healthy rank's fault in vLLM's terms, within half of the faulted rank's
    recovery window (the other half is the orchestrator's, to send ``retry`` to every rank), or
    sooner where ``cpu_distributed_timeout_seconds``, vLLM's bound on its own collectives on that
    group, is shorter. The price: a peer that reaches the gather later than that (the forward's
    MoE collectives keep the ranks within one step of each other) is a fault on every rank too,
    which recovery then handles.
    """
    if not getattr(parallel_config, "enable_fault_tolerance", False):
        return None
    recovery_s = parallel_config.fault_tolerance_config.engine_recovery_timeout_sec
    bound = GatherTimeout(
        recovery_s * RECOVERY_SHARE, f"half of engine_recovery_timeout_sec={recovery_s}"
    )
    cpu_s = getattr(parallel_config, "cpu_distributed_timeout_seconds", None)
    if cpu_s is not None and cpu_s < bound.seconds:
        return GatherTimeout(float(cpu_s), f"cpu_distributed_timeout_seconds={cpu_s}")
    return bound


class RunningCountGather:
    """The gathered counts of every DP rank, where the gate reads them: ``balance_queue``.

    A base of ``BalanceSchedulerMixin``, behind it in the MRO: the gate calls ``_init_gather()``
    from its ``__init__`` when balance is on; with balance off none of this state exists.
    """

    # Upstream attributes the gather reads, on every supported release (test_upstream_surface.py).
    running: list
    pause_state: Any  # where PAUSED_ALL exists
    _balance_enabled: bool
    if TYPE_CHECKING:

        def leader_at_cap(self) -> bool: ...

    def _init_gather(self, options: BalanceOptions, parallel_config: ParallelConfig) -> None:
        self._all_gather = options.collective == ALL_GATHER
        self._max_frozen_steps = options.max_frozen_steps
        self.balance_stats = BalanceStats()
        timeout = gather_timeout_under_fault_tolerance(parallel_config)
        # None: gloo's own timeout, the contract's plain all_gather (fault tolerance off).
        self._gather_timeout = None if timeout is None else timedelta(seconds=timeout.seconds)
        self._gather_watchdog = GatherWatchdog(
            options.gather_warn_s,
            parallel_config.data_parallel_rank,
            parallel_config.data_parallel_size,
            self.balance_stats,
        )
        # The group the buffer is sized for; until one is handed over, the config's size (the
        # simulator and tests fill the buffer without a group).
        self._gather_group: Any = None
        self._reset_gathered(parallel_config.data_parallel_size, parallel_config.data_parallel_rank)

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
        (``ElasticEPScalingState._commit_new_dp_group``), and with a rebuilt one on a
        fault-tolerance ``retry`` (``EngineCoreSentinel``'s group re-init), and keeps the
        scheduler; the engine core hands each group over as vLLM assigns it, so the next
        ``schedule()`` already reads a zeroed buffer of the new group
        (``BalanceDPEngineCoreProc.dp_group``), not the counts gathered before the fault.
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
        watchdog.raised = None
        watchdog.started = started = time.monotonic()
        try:
            if self._gather_timeout is not None:
                reduced = self._gather_within(running, self._gather_timeout)
            elif self._all_gather:
                running_count = torch.tensor([running], dtype=torch.int32)
                dist.all_gather(self.balance_queue, running_count, group=self.dp_group)
            else:
                reduced = collective.reduce_running(running, self.dp_group)
                self.set_gathered([reduced.maximum])
        except BaseException as exc:
            watchdog.gather_raised(exc)  # logged as "failed", by the watchdog
            raise
        finally:
            watchdog.started = None
        self.balance_stats.gather_seconds += time.monotonic() - started
        self.observe_gathered(reduced)

    def _gather_within(self, running: int, timeout: timedelta) -> collective.Reduced | None:
        """The same collective, same group and payload, failing after ``timeout`` with a
        ``RuntimeError`` from gloo (``gather_timeout_under_fault_tolerance``).

        The timeout is this operation's own (gloo's per-operation option, a wait bound on each
        point-to-point message), not the group's default: vLLM's own collectives on its DP group
        keep the timeouts vLLM gives them.
        """
        if self._all_gather:
            options = AllgatherOptions()
            options.timeout = timeout
            running_count = torch.tensor([running], dtype=torch.int32)
            self.dp_group.allgather([self.balance_queue], [running_count], options).wait()
            return None
        reduced = collective.reduce_running(running, self.dp_group, timeout)
        self.set_gathered([reduced.maximum])
        return reduced

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
