"""The balance state of one scheduler: the gathered counts, the gate read from them, the gather.

``BalanceGate`` is the one object a balance scheduler carries (``scheduler.balance_gate``,
``None`` with balance off); the scheduler mixin (``shim/scheduler.py``) keeps only what vLLM
calls. The engine core says when to gather (``BalanceDPEngineCoreProc``).

With vLLM's fault tolerance on (``--enable-fault-tolerance``) the gather fails after
``gather_timeout_under_fault_tolerance`` instead of waiting for gloo's own timeout: see there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from vllm_balance.config import ALL_GATHER, BalanceOptions
from vllm_balance.shim import collective
from vllm_balance.shim.collective import NO_TIMEOUT
from vllm_balance.shim.metrics import BalanceMetrics
from vllm_balance.shim.stats import BalanceStats, PeriodicLog
from vllm_balance.shim.watchdog import GatherWatchdog

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


class BalanceGate:
    """One scheduler's balance state, owned by it alone (two schedulers in one process, as the
    simulator's ranks, never share one).

    Every active step: ``gather()`` fills the counts (or ``set_gathered()``, the gather's second
    half, where a simulator or test has no group), then the scheduler's ``schedule()`` asks
    ``start_step()`` whether this step is frozen, and a hold records in ``deferred`` that it kept
    a fresh request waiting.
    """

    def __init__(self, options: BalanceOptions, parallel_config: ParallelConfig, cap: int) -> None:
        self.cap = cap  # the admission limit the WAITING loop stops at
        self.frozen = False  # this step's decision (contract 1)
        self.deferred = False  # this step's hold kept a fresh request waiting
        self.stats = BalanceStats()
        self.metrics = BalanceMetrics()
        self._periodic_log = PeriodicLog(options.log_interval_s, self.metrics)
        # The contract's all_gather of every count, or the opt-in reduction to max, min and sum.
        self.all_gather = options.collective == ALL_GATHER
        self._max_frozen_steps = options.max_frozen_steps
        timeout = gather_timeout_under_fault_tolerance(parallel_config)
        # None: gloo's own timeout, the contract's plain all_gather (fault tolerance off).
        self._timeout = None if timeout is None else timedelta(seconds=timeout.seconds)
        self.watchdog = GatherWatchdog(
            options.gather_warn_s,
            parallel_config.data_parallel_rank,
            parallel_config.data_parallel_size,
            self.stats,
        )
        self.group: Any = None  # vLLM's DP group, once the engine core hands it over
        self._reset(parallel_config.data_parallel_size, parallel_config.data_parallel_rank)

    def _reset(self, dp_size: int, dp_rank: int) -> None:
        """A zeroed buffer for ``dp_size`` ranks, and the state counted from gathered counts.

        The first step on a new DP group is decided as the first step after start-up: open on
        every rank, as no count has been gathered on that group yet (docs/design.md, "When the
        DP group changes, pauses or faults").
        """
        self.dp_size, self.dp_rank = dp_size, dp_rank
        # The all_gather's output, a view per rank (the reduction returns its result: no buffer).
        self._buffer = torch.zeros(dp_size if self.all_gather else 0, dtype=torch.int32)
        self._buffer_views = list(self._buffer.split(1))
        self.leader = 0  # the largest count gathered last: the gate's input
        self._frozen_streak = 0
        self._release_next_step = False
        self.stats.last_gathered = []
        self.watchdog.follow(dp_rank, dp_size)

    def follow_group(self, group: Any) -> None:
        """Gather on ``group`` from now on, sized and ranked by it.

        vLLM replaces its DP group object, with a new size and rank, on an elastic-EP resize
        (``ElasticEPScalingState._commit_new_dp_group``), and with a rebuilt one on a
        fault-tolerance ``retry`` (``EngineCoreSentinel``'s group re-init), and keeps the
        scheduler; the engine core hands each group over as vLLM assigns it, so the next
        ``schedule()`` already reads the zeroed counts of the new group
        (``BalanceDPEngineCoreProc.dp_group``), not the counts gathered before the fault.
        """
        if group is not None and group is not self.group:
            self._reset(group.size(), group.rank())
        self.group = group

    def leader_at_cap(self) -> bool:
        """Contract 1: some rank was at the cap at the end of the previous step (``==``, not
        ``>= cap - 1``: docs/design.md, "The cap")."""
        return self.leader == self.cap

    def start_step(self, request_counts: Callable[[], tuple[int, int]]) -> bool:
        """This step's decision, made once when ``schedule()`` starts: whether it is frozen.

        ``request_counts`` is upstream's ``get_request_counts`` (its waiting queues differ
        between releases), asked only on a frozen step, for the deferred-admissions counter.
        """
        at_cap = self.leader_at_cap()
        released = at_cap and self._release_next_step
        self.frozen = frozen = at_cap and not released
        self.deferred = False
        num_waiting = request_counts()[1] if frozen else 0
        self.stats.record_step(frozen, released, num_waiting, self.dp_rank)
        self._periodic_log.maybe_log(self.stats, self.dp_rank)
        return frozen

    def gather(self, running: int) -> None:
        """All-gather ``running`` (the mixin's count: ``len(self.running)``, 0 while paused with
        ``mode="keep"``) on the DP group; nothing before the engine core hands a group over.

        The watchdog reports a gather a peer never enters (docs/operations.md, "A blocked
        gather").
        """
        group = self.group
        if group is None:
            return
        watchdog = self.watchdog
        if watchdog.unstarted:
            watchdog.start_for(self)
        watchdog.raised = None
        watchdog.started = started = time.monotonic()
        try:
            if self.all_gather:
                payload = torch.tensor([running], dtype=torch.int32)
                if self._timeout is None:
                    dist.all_gather(self._buffer_views, payload, group=group)
                else:
                    self._all_gather_within(payload, self._timeout)
            else:
                reduced = collective.reduce_running(running, group, self._timeout or NO_TIMEOUT)
        except BaseException as exc:
            watchdog.gather_raised(exc)  # logged as "failed", by the watchdog
            raise
        finally:
            watchdog.started = None
        self.stats.gather_seconds += time.monotonic() - started
        if self.all_gather:
            self.set_gathered(self._buffer.tolist())
        else:
            self.stats.record_reduced(*reduced, self.dp_size)
            self._count_streak(reduced.maximum)

    def _all_gather_within(self, payload: torch.Tensor, timeout: timedelta) -> None:
        """The same all_gather, same group and payload, failing after ``timeout`` with a
        ``RuntimeError`` from gloo (``gather_timeout_under_fault_tolerance``).

        The timeout is this operation's own (gloo's per-operation option, a wait bound on each
        point-to-point message), not the group's default: vLLM's own collectives on its DP group
        keep the timeouts vLLM gives them.
        """
        options = AllgatherOptions()
        options.timeout = timeout
        self.group.allgather([self._buffer_views], [payload], options).wait()

    def set_gathered(self, counts: Sequence[int]) -> None:
        """The gather's second half: every rank's count arrived (one per rank, in rank order).

        What the gate reads at the next ``start_step()``, the statistics and the bounded hold's
        streak. ``gather()`` calls it; a simulator or test without a DP group calls it in its
        place, with as many counts as its scenario has ranks.
        """
        self.stats.record_gather(list(counts))
        self._count_streak(max(counts))

    def _count_streak(self, leader: int) -> None:
        """The gate's input and the bounded hold's streak, after each gather.

        The streak is counted here, where every rank sees the same data, not in ``schedule()``,
        which a drained rank never enters (lesson A).
        """
        self.leader = leader
        if self._max_frozen_steps is not None:
            at_cap = self.leader_at_cap()
            self._frozen_streak = self._frozen_streak + 1 if at_cap else 0
            self._release_next_step = self._frozen_streak > self._max_frozen_steps
            if self._release_next_step:
                self._frozen_streak = 0
