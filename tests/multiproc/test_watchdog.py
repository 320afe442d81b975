"""A gather blocked by a paused peer is reported by every rank waiting in it, and so is
its return. Real engine-core processes and gloo groups (``harness.py``); the paused rank stops
itself with SIGSTOP right after its forward's collective (``standin.PAUSE_AFTER_FORWARD_ENV``), so
the others' next DP collective is the balance gather.

The lesson-A and lesson-B controls (``test_deadlocks.py``) check the same lines on a deadlock.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import psutil
import pytest

from balance_testbed.waiting import wait_for
from tests.multiproc.events import Add, Trace, TraceResult
from tests.multiproc.harness import Cluster
from tests.multiproc.invariants import check_trace
from tests.multiproc.standin import PAUSE_AFTER_FORWARD_ENV
from tests.multiproc.watchdog_log import WatchdogLine, watchdog_lines
from vllm_balance.config import GATHER_WARN_KEY

pytestmark = [pytest.mark.timeout(600), pytest.mark.path_independent]

WARN_S = 1.0
# Allowance on top of WARN_S for a loaded 2-core machine: the watchdog thread's wake-up, the log
# write, and this process's polling of the log files.
SLACK_S = 4.0
# The victim stops after this many forwards, i.e. before gather #PAUSE_AFTER (one gather per
# forward); not a multiple of 32 (see PAUSE_AFTER_FORWARD_ENV).
PAUSE_AFTER = 10


def _wait_for(cluster: Cluster, predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Pump the cluster until ``predicate()``; return the monotonic time it first held."""

    def pump(seconds: float) -> None:
        cluster.pump(timeout_ms=round(seconds * 1000))

    if wait_for(predicate, timeout, 0.02, pause=pump) is None:
        logs = "\n".join(f"--- rank {r}\n{cluster.log_tail(r, 20)}" for r in range(cluster.dp_size))
        raise AssertionError(f"not within {timeout:.1f} s: {what}\n{logs}")
    return time.monotonic()


def _lines(cluster: Cluster, rank: int, kind: str) -> list[WatchdogLine]:
    return [line for line in watchdog_lines(cluster.log(rank)) if line.kind == kind]


def test_paused_rank_every_other_rank_logs_the_blocked_gather_then_its_return():
    dp, victim = 3, 1
    others = [rank for rank in range(dp) if rank != victim]
    trace = Trace("pause-mid-decode", dp, [Add(r, f"req-{r}", 8, 40) for r in range(dp)])
    cluster = Cluster(
        dp,
        additional_config={GATHER_WARN_KEY: WARN_S},
        extra_env={PAUSE_AFTER_FORWARD_ENV: f"{victim}:{PAUSE_AFTER}"},
    )
    with cluster:
        started = time.monotonic()
        cluster.play(trace.events)
        victim_process = psutil.Process(cluster.procs[victim].pid)
        paused_at = _wait_for(
            cluster,
            lambda: victim_process.status() == psutil.STATUS_STOPPED,
            60,
            f"rank {victim} to stop itself after forward {PAUSE_AFTER}",
        )
        reported_at = {
            rank: _wait_for(
                cluster,
                lambda rank=rank: bool(_lines(cluster, rank, "blocked")),
                WARN_S + SLACK_S - (time.monotonic() - paused_at),
                f"rank {rank} to log the blocked gather",
            )
            for rank in others
        }
        for rank in others:  # the error repeats while the wait goes on (at 2 x WARN_S)
            _wait_for(
                cluster,
                lambda rank=rank: len(_lines(cluster, rank, "blocked")) >= 2,
                WARN_S + SLACK_S,
                f"rank {rank} to repeat the error",
            )
        assert watchdog_lines(cluster.log(victim)) == []  # a stopped process logs nothing
        os.kill(victim_process.pid, signal.SIGCONT)
        for rank in others:
            _wait_for(
                cluster,
                lambda rank=rank: bool(_lines(cluster, rank, "unblocked")),
                SLACK_S,
                f"rank {rank} to log the gather's return",
            )
        cluster.wait_until(cluster.wave_ended, "the wave to end after SIGCONT")
        blocked = {rank: _lines(cluster, rank, "blocked") for rank in others}
        unblocked = {rank: _lines(cluster, rank, "unblocked") for rank in others}
        result = TraceResult(
            trace, dict(cluster.requests), cluster.drain_records(), 1, time.monotonic() - started
        )
    assert cluster.leftover_processes() == []
    check_trace(result)  # the run recovered completely: every request, one gather per step
    for rank in others:
        # Within the configured time, about the gather the victim did not enter, and only that.
        assert reported_at[rank] - paused_at <= WARN_S + SLACK_S, (rank, reported_at, paused_at)
        first = blocked[rank][0]
        assert first.rank == rank and first.gather == PAUSE_AFTER, blocked[rank]
        assert WARN_S <= first.seconds <= WARN_S + SLACK_S, first
        assert first.last.startswith(f" (gather #{PAUSE_AFTER - 1}): DP0=1 DP1=1 DP2=1"), first
        assert [(line.gather, line.seconds) for line in blocked[rank][:2]] == [
            (PAUSE_AFTER, first.seconds),
            (PAUSE_AFTER, pytest.approx(2 * first.seconds, abs=0.15)),
        ], blocked[rank]
        assert {line.gather for line in blocked[rank]} == {PAUSE_AFTER}, blocked[rank]
        assert [(line.rank, line.gather) for line in unblocked[rank]] == [(rank, PAUSE_AFTER)]
        assert unblocked[rank][0].seconds >= first.seconds
