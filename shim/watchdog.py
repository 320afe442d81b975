"""The gather watchdog: one thread per rank reports a ``balance_gather()`` that does not return.

Why a gather is watched at all is in ``BalanceSchedulerMixin.balance_gather``'s docstring. The
gathering thread's whole part is to write ``GatherWatchdog.started`` (a ``time.monotonic()``
timestamp) before its all_gather and clear it after. Everything else happens here, on one daemon
thread started with the rank's first gather: it sleeps until the gather in flight would be
``warn_s`` old, logs ``BLOCKED`` (ERROR) if that same gather is still in flight, repeats it each
time the wait doubles and at least every ``MAX_REPEAT_S``, and logs ``UNBLOCKED`` (WARNING) when
that gather returns, ``FAILED`` (ERROR, with the exception) when it raised (the gather reports
it through ``gather_raised``, which logs it at once if the thread had not reported it blocked: a
gather that fails sooner than ``warn_s``, such as one bounded under vLLM's fault tolerance). A
healthy rank's thread wakes once per ``warn_s`` and finds nothing to say.

The messages are an interface (docs/operations.md, Troubleshooting; the server test greps
them); change their first words only together with the docs:

    balance gather blocked: DP1 has waited 5.0 s in gather #1234 of 2 DP ranks; last gathered
        running counts (gather #1233): DP0=3 DP1=4; a rank that logs no ...
    balance gather unblocked: DP1 gather #1234 returned after 7.3 s ...
    balance gather failed: DP1 gather #1234 raised after 8.1 s: RuntimeError: ...

The gather number is the rank's count of gathers on its current DP group, and every rank gathers
once per active step (contract 3), so ranks in the same gather report the same number.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

from vllm_balance.log import logger
from vllm_balance.shim.stats import BalanceStats

BLOCKED = "balance gather blocked"
UNBLOCKED = "balance gather unblocked"
FAILED = "balance gather failed"
# Upper bound on the gap between two error lines for one blocked gather.
MAX_REPEAT_S = 60.0
# How often the thread looks again while a reported gather is still in flight: the UNBLOCKED
# line and its duration are late by at most this much.
BLOCKED_POLL_S = 0.1


@dataclass
class _BlockedGather:
    started: float
    number: int
    # The wait (seconds) at which the next error line is due.
    next_report_s: float


class GatherWatchdog:
    """Watches ``started``, the monotonic time the rank's gather in flight began (or ``None``).

    ``warn_s=None`` is the watchdog turned off: ``started`` is still written, nothing reads it.
    """

    def __init__(
        self,
        warn_s: float | None,
        dp_rank: int,
        dp_size: int,
        stats: BalanceStats,
    ) -> None:
        self.started: float | None = None
        # What the gather in flight raised, set before it clears ``started``.
        self.raised: BaseException | None = None
        self.warn_s = warn_s
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        # Its blocked_gathers is counted here, as the report is made: the blocked rank's
        # scheduler is in the gather and logs (and publishes) nothing until it returns.
        self.stats = stats
        self._blocked: _BlockedGather | None = None
        # Orders a raised gather's report between this thread and the gathering thread, which
        # takes it only when its gather raised: exactly one of the two logs FAILED.
        self._lock = threading.Lock()
        # stats.gathers before the current DP group: gathers are numbered from the group's first.
        self._gathers_before_group = 0
        self.unstarted = True
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"balance-gather-watchdog-DP{dp_rank}", daemon=True
        )

    def follow(self, dp_rank: int, dp_size: int) -> None:
        """A new DP group (an elastic-EP resize): its rank and size in the messages, and gathers
        numbered from its first, so that ranks blocked together still log the same number."""
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._gathers_before_group = self.stats.gathers
        self._thread.name = f"balance-gather-watchdog-DP{dp_rank}"

    def start_for(self, owner: object) -> None:
        """Start the thread on ``owner``'s (the scheduler's) first gather; it ends with ``owner``.

        The scheduler calls it only while ``unstarted``, a plain attribute: checking that is all
        a later gather pays (a method call per gather cost ~900 instructions more, measured with
        benchmarks/instructions.py --gather-only).
        """
        self.unstarted = False
        if self.warn_s is not None:
            self._thread.start()
            weakref.finalize(owner, self.close)

    def close(self) -> None:
        """Stop the thread (at its next wake-up, which this triggers)."""
        self._closed.set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        assert self.warn_s is not None
        sleep_s = self.warn_s
        while not self._closed.wait(sleep_s):
            sleep_s = self.check(time.monotonic())

    def gather_raised(self, exc: BaseException) -> None:
        """The gathering thread's part when its gather raised: ``FAILED``, logged at once.

        At once, not at this thread's next look: under vLLM's fault tolerance the rank's next
        gather (after ``retry``) can start within that look's 0.1 s and would hide how this one
        ended. Also for a gather not yet reported blocked (a timeout shorter than ``warn_s``, a
        peer's closed connection). The lock makes it one line per gather, whichever thread looks.
        """
        with self._lock:
            self.raised = exc
            started, self.started = self.started, None
            blocked = self._blocked
            if self.warn_s is None or started is None:
                return
            if blocked is None or blocked.started != started:
                number = self.stats.gathers - self._gathers_before_group + 1
                blocked = _BlockedGather(started, number, 0.0)
            self._blocked = None
            self._report_unblocked(blocked, time.monotonic() - started, exc)

    def check(self, now: float) -> float:
        """Look at the gather in flight once, log what is due; return seconds until next look."""
        with self._lock:
            return self._check(now)

    def _check(self, now: float) -> float:
        assert self.warn_s is not None
        # Read before ``started``: the gather thread clears ``started`` before it counts the
        # gather, so a gather seen in flight here is number ``completed + 1``.
        completed = self.stats.gathers - self._gathers_before_group
        raised = self.raised  # before ``started``, which the gather clears after setting it
        started = self.started
        blocked = self._blocked
        if blocked is not None and started != blocked.started:
            self._report_unblocked(blocked, now - blocked.started, raised)
            blocked = self._blocked = None
        if started is None:
            return self.warn_s
        waited = now - started
        if blocked is None:
            if waited < self.warn_s:
                return self.warn_s - waited
            blocked = self._blocked = _BlockedGather(started, completed + 1, waited)
            self.stats.blocked_gathers += 1
        self.stats.longest_gather_wait_s = max(self.stats.longest_gather_wait_s, waited)
        if waited >= blocked.next_report_s:
            self._report_blocked(blocked, waited)
            blocked.next_report_s = waited + min(max(waited, self.warn_s), MAX_REPEAT_S)
        return min(BLOCKED_POLL_S, blocked.next_report_s - waited)

    def _report_blocked(self, blocked: _BlockedGather, waited: float) -> None:
        last, stats = self.stats.last_gathered, self.stats
        if last:
            last_seen = f" (gather #{blocked.number - 1}): " + " ".join(
                f"DP{rank}={count}" for rank, count in enumerate(last)
            )
        elif blocked.number > 1:  # the log-depth reduction: no per-rank counts, only max, min
            last_seen = (
                f" (gather #{blocked.number - 1}): max {stats.gathered_max}, "
                f"min {stats.gathered_min} (reduced, no per-rank counts)"
            )
        else:
            last_seen = ": none yet"
        logger.error(
            "%s: DP%d has waited %.1f s in gather #%d of %d DP ranks; last gathered running "
            "counts%s; a rank that logs no '%s' line for gather #%d has not entered it: check "
            "that rank (docs/operations.md, Troubleshooting)",
            BLOCKED,
            self.dp_rank,
            waited,
            blocked.number,
            self.dp_size,
            last_seen,
            BLOCKED,
            blocked.number,
        )

    def _report_unblocked(
        self, blocked: _BlockedGather, waited: float, raised: BaseException | None
    ) -> None:
        self.stats.longest_gather_wait_s = max(self.stats.longest_gather_wait_s, waited)
        if raised is not None:
            logger.error(
                "%s: DP%d gather #%d raised after %.1f s: %s: %s (blocked gathers on this rank: "
                "%d)",
                FAILED,
                self.dp_rank,
                blocked.number,
                waited,
                type(raised).__name__,
                raised,
                self.stats.blocked_gathers,
            )
            return
        logger.warning(
            "%s: DP%d gather #%d returned after %.1f s (blocked gathers on this rank: %d)",
            UNBLOCKED,
            self.dp_rank,
            blocked.number,
            waited,
            self.stats.blocked_gathers,
        )
