"""BalanceScheduler: vLLM's scheduler plus a global admission gate, on the seam.

The engine core calls ``balance_gather()`` once per active step (never ``schedule()``: lessons A
and B in docs/design.md); when the largest gathered ``len(self.running)`` **equals** the cap, no
rank admits WAITING requests this step. The counts, the decision and the gather are the
scheduler's one ``BalanceGate`` (``shim/gather.py``); the mixin keeps what vLLM calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import SchedulerStats

from vllm_balance.config import read_options
from vllm_balance.shim.gather import BalanceGate

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
    """Balance on vLLM's scheduler; mixed in front of ``Scheduler`` or ``AsyncScheduler``.

    It adds one attribute to vLLM's scheduler, ``balance_gate`` (``None``: balance off, nothing
    allocated, every override upstream's own), so that no upstream rename can collide with a
    second one. ``gate_class`` is what a variant of the gate replaces (the simulator's policies).
    """

    gate_class: type[BalanceGate] = BalanceGate
    # Upstream attributes read here, on every supported release (test_upstream_surface.py).
    max_num_running_reqs: int
    prefill_capacity_bound: bool
    running: list
    pause_state: Any  # where PAUSED_ALL exists
    if TYPE_CHECKING:

        def get_request_counts(self) -> tuple[int, int]: ...

    def __init__(self, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        options = read_options(vllm_config)  # None: balance off
        self.balance_gate: BalanceGate | None = None
        if options is not None:
            # Feature detection, not a version: the admission limit the WAITING loop stops at.
            cap = getattr(self, "max_num_active_reqs", self.max_num_running_reqs)
            self.balance_gate = self.gate_class(options, vllm_config.parallel_config, cap)

    def follow_dp_group(self, group: Any) -> None:
        """The engine core hands over each DP group vLLM assigns (``BalanceGate.follow_group``)."""
        if self.balance_gate is not None:
            self.balance_gate.follow_group(group)

    def balance_gather(self) -> None:
        """The engine core's once-per-active-step gather of ``len(self.running)``.

        A rank paused with ``mode="keep"`` contributes 0, as vLLM's own DP sync counts it
        (``get_num_unfinished_requests()`` is 0 under ``PAUSED_ALL``): it schedules no token, so
        its full slots must not freeze the ranks that run.
        """
        gate = self.balance_gate
        if gate is None:
            return
        running = len(self.running)
        if running and PAUSED_ALL is not None and self.pause_state == PAUSED_ALL:
            running = 0
        gate.gather(running)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        gate = self.balance_gate
        if gate is not None and gate.start_step(self.get_request_counts):
            return self._held_schedule(gate, throttle_prefills)
        return super().schedule(throttle_prefills)

    def _held_schedule(self, gate: BalanceGate, throttle_prefills: bool) -> SchedulerOutput:
        """A frozen step: upstream's, but a step the gate held records nothing for vLLM's prefill
        cadence (a hold is policy, not capacity: docs/design.md, Phase 2B, "a hold is not a
        capacity limit")."""
        capacity_bound = self.prefill_capacity_bound
        output, gate.deferred = self._hold_and_schedule(throttle_prefills)
        if gate.deferred:
            self.prefill_capacity_bound = capacity_bound
        return output

    def _hold_and_schedule(self, throttle_prefills: bool) -> tuple[SchedulerOutput, bool]:
        """Upstream's step under this path's hold, and whether the hold stopped an admission.

        Here the seam (or a gate inlined where the seam is called) holds and records it in
        ``deferred``; a path that holds another way (the pause-state hold) overrides this."""
        output = self._upstream_schedule(throttle_prefills)
        assert self.balance_gate is not None  # only a frozen step gets here
        return output, self.balance_gate.deferred

    def _upstream_schedule(self, throttle_prefills: bool) -> SchedulerOutput:
        return super().schedule(throttle_prefills)

    def make_stats(self, *args: Any, **kwargs: Any) -> SchedulerStats | None:
        """Upstream's stats; after a publish, carrying its counters to the API server
        (shim/metrics.py). Arguments as upstream's, whose signature differs between releases."""
        stats = super().make_stats(*args, **kwargs)
        gate = self.balance_gate
        if gate is None or not gate.metrics.pending or stats is None:
            return stats
        return gate.metrics.attach(stats)

    def _should_stop_admitting_waiting(self) -> bool:
        """The seam: called after upstream's own slot check, before a fresh request (0.31+:
        KV-holders drain first); records that the gate stopped one (docs/design.md, Phase 2B)."""
        gate = self.balance_gate
        if gate is None or not gate.frozen:
            return False
        gate.deferred = True
        return True


class BalanceScheduler(BalanceSchedulerMixin, Scheduler):
    """Balance on top of the synchronous ``Scheduler`` (needs the seam)."""


class BalanceAsyncScheduler(BalanceSchedulerMixin, AsyncScheduler):
    """Balance on top of ``AsyncScheduler``, which vLLM builds when async scheduling is on."""
