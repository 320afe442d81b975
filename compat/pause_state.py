"""The pause-state hold: a frozen step is upstream's ``schedule()`` under ``PauseState.PAUSED_NEW``.

vLLM's ``SchedulerInterface`` documents ``PAUSED_NEW`` as "no new requests are scheduled; requests
already running or holding KV blocks are scheduled", which is contract 1's hold. Held for exactly
one step it gives the frozen step of the seam (``_should_stop_admitting_waiting``) with no copy of
``schedule()`` and no vLLM change, on every release whose ``PAUSED_NEW`` does what the interface
says (0.31's skips the KV-holding queue too: docs/design.md, "The pause-state hold").

Rules of the temporary state, each a lesson:

- **Only raised, never lowered**: under an operator's ``/pause`` (``PAUSED_NEW`` or ``PAUSED_ALL``)
  the step runs as the operator set it.
- **Restored before ``schedule()`` returns, also when it raises**: nothing outside the step
  (``get_num_unfinished_requests()``, the engine core's pause handling, stats) sees it.
- **Set on the attribute, not through ``set_pause_state()``**, which logs at INFO: a frozen step
  is routine, and a line per step would flood the log.
"""

from __future__ import annotations

import os
from functools import cache
from typing import TYPE_CHECKING, Any, cast

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_balance.compat.derive import VerifiedRef, verified_refs
from vllm_balance.log import logger
from vllm_balance.shim.scheduler import BalanceSchedulerMixin

if TYPE_CHECKING:  # what the hold is put in front of, so that its calls type-check
    from vllm_balance.shim.scheduler import BalanceSchedulerMixin as _Base
else:
    _Base = object

# Which hold each verified schedule() gets: its fingerprints.json entry (written by `nox -s
# reach`, docs/support-matrix.md).
PAUSE_STATE, DERIVED_COPY = "pause-state", "derived-copy"
REACH_COMMAND = "nox -s reach -- --versions {release}"
# An operator's override of the recorded hold (and how `nox -s reach` runs each hold on a release).
HOLD_ENV = "VLLM_BALANCE_HOLD"


class _Unrecorded(int):
    """``prefill_capacity_bound``'s value before a held step, marked: still this type after the
    step means upstream recorded nothing (its PAUSED_NEW skipped the whole WAITING block)."""


def _preempted(output: SchedulerOutput) -> bool:
    return bool(getattr(output, "preempted_req_ids", None))


class PauseStateHold(_Base):
    """A frozen step: upstream's ``schedule()`` with the pause state raised to ``PAUSED_NEW``."""

    _pause_state: PauseState
    prefill_capacity_bound: bool
    waiting: Any
    max_num_scheduled_tokens: int
    num_waiting_for_streaming_input: int

    def _hold_and_schedule(self, throttle_prefills: bool) -> tuple[SchedulerOutput, bool]:
        operator_pause = self._pause_state
        assert self.balance_gate is not None  # only a frozen step gets here
        cap = self.balance_gate.cap
        if operator_pause != PauseState.UNPAUSED or not self._hold_can_matter(cap):
            return self._upstream_schedule(throttle_prefills), False
        capacity_bound = self.prefill_capacity_bound
        deferring = throttle_prefills and not capacity_bound
        self.prefill_capacity_bound = cast(bool, _Unrecorded(capacity_bound))
        self._pause_state = PauseState.PAUSED_NEW
        try:
            output = self._upstream_schedule(throttle_prefills)
        finally:
            self._pause_state = operator_pause
            recorded = type(self.prefill_capacity_bound) is not _Unrecorded
            if not recorded:
                self.prefill_capacity_bound = capacity_bound
        held = self._hold_kept_fresh_requests(output, cap)
        if not held and not recorded and not deferring and not _preempted(output):
            # The running requests spent the token budget: upstream's WAITING loop would not
            # have run, yet would have recorded the backlog, which this release's PAUSED_NEW
            # skips with the loop (0.24-0.30); record it as upstream does there.
            self.prefill_capacity_bound = bool(self.waiting)
        return output, held

    def _hold_can_matter(self, cap: int) -> bool:
        """A fresh request waits and a slot is free: otherwise upstream's own step is the frozen
        step already (running only shrinks before the WAITING loop, by preemption, which skips
        it), and runs unpaused, recording what upstream records."""
        return self._fresh_waiting() > 0 and self._slots_in_use() < cap

    def _hold_kept_fresh_requests(self, output: SchedulerOutput, cap: int) -> bool:
        """Whether the hold, not upstream's own limits, kept a fresh request waiting: one is still
        waiting, the step preempted nothing (a preempting step skips the WAITING loop), and
        slots and token budget were left (either one stops the loop before any hold would)."""
        return (
            self._fresh_waiting() > 0
            and not _preempted(output)
            and self._slots_in_use() < cap
            and output.total_num_scheduled_tokens < self.max_num_scheduled_tokens
        )

    def _fresh_waiting(self) -> int:
        """Waiting requests that hold no KV blocks (0.31+ keeps those in their own queue)."""
        _, num_waiting = self.get_request_counts()
        return num_waiting - len(getattr(self, "kv_holding_waiting", ()))

    def _slots_in_use(self) -> int:
        """What upstream's slot check counts: running requests and paused streaming sessions."""
        return len(self.running) + self.num_waiting_for_streaming_input


class PauseStateBalanceScheduler(PauseStateHold, BalanceSchedulerMixin, Scheduler):
    """Balance on the synchronous ``Scheduler`` of a vLLM without the seam."""


class PauseStateBalanceAsyncScheduler(PauseStateHold, BalanceSchedulerMixin, AsyncScheduler):
    """Balance on ``AsyncScheduler`` (vLLM's default) of a vLLM without the seam."""


@cache
def verified_holds() -> dict[str, VerifiedRef]:
    """schedule() fingerprint -> its entry in fingerprints.json (release, hold, evidence)."""
    return {ref.fingerprint: ref for ref in verified_refs()}


def installed_schedule_fingerprint() -> str:
    import ast
    import inspect

    import vllm
    from vllm.v1.core.sched import scheduler

    from vllm_balance.compat.derive import find_schedule, fingerprint

    tree = ast.parse(inspect.getsource(scheduler))
    return fingerprint(find_schedule(tree, vllm.__version__))


def schedule_reads_pause_state() -> bool:
    """Whether the installed ``Scheduler.schedule`` reads ``self._pause_state``, the attribute a
    held step sets: on a vLLM that renamed it the hold would be a silent no-op."""
    import inspect

    return "self._pause_state" in inspect.getsource(Scheduler.schedule)


def hold_for_installed_vllm() -> str:
    """``PAUSE_STATE`` or ``DERIVED_COPY`` for the installed vLLM without the seam.

    Decided by the installed ``schedule()`` itself (its fingerprint), never by a version string:
    a verified one gets the hold its differential chose (``DERIVED_COPY`` where a one-step
    ``PAUSED_NEW`` differs from the contract's hold, or was not yet compared). An unverified one
    (a newer vLLM, a fork) gets the pause-state hold, trusting ``PAUSED_NEW`` as vLLM's interface
    documents it, with a warning naming the release and how to verify it: refusing would take
    balance away from every new release until a derivation catches up, which is the failure this
    path exists to end. ``VLLM_BALANCE_HOLD`` overrides the record, with a warning: an operator's
    way back to the derived copy, and how ``nox -s reach`` runs each hold on a release.
    """
    import vllm

    forced = os.environ.get(HOLD_ENV)
    if forced:
        if forced not in (PAUSE_STATE, DERIVED_COPY):
            raise ValueError(f"{HOLD_ENV} must be {PAUSE_STATE} or {DERIVED_COPY}, got {forced!r}")
        logger.warning(
            "balance scheduling: %s=%s overrides the hold recorded for vLLM %s's "
            "Scheduler.schedule (compat/fingerprints.json)",
            HOLD_ENV,
            forced,
            vllm.__version__,
        )
        return forced
    found = installed_schedule_fingerprint()
    entry = verified_holds().get(found)
    if entry is not None:
        return entry.hold
    if not schedule_reads_pause_state():
        raise RuntimeError(
            f"balance scheduling cannot hold on vLLM {vllm.__version__}: its "
            "Scheduler.schedule does not read self._pause_state, so a PAUSED_NEW hold would be "
            "ignored. Turn balance scheduling off on this vLLM (upstream_patch/README.md)"
        )
    logger.warning(
        "balance scheduling: vLLM %s's Scheduler.schedule (fingerprint %s) is not verified; "
        "holding frozen steps with vLLM's PauseState.PAUSED_NEW as its SchedulerInterface "
        "documents it. Verify this release with `%s`",
        vllm.__version__,
        found,
        REACH_COMMAND.format(release=vllm.__version__),
    )
    return PAUSE_STATE
