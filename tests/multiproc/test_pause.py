"""Pause and sleep with balance on, in real engine-core processes (``harness.py``).

Two shapes:

- every rank paused or put to sleep (what the API server does: ``pause_generation`` and
  ``sleep`` call every engine): vLLM's two-phase DP pause keeps the ranks in lock step, so the
  gather, which runs only on active steps, is entered by every rank or by none. Each mode
  (``abort``, ``wait``, ``keep``, and ``sleep`` level 1) must complete on every rank, resume, and
  leave a run that satisfies every trace invariant (one gather per step, the same vector on every
  rank, the contract's gate decisions);
- one rank paused with ``mode="keep"`` (a per-rank ``/pause`` under external load balancing)
  while it holds ``cap`` running requests: it schedules nothing, so it contributes 0 to the gather
  (vLLM's own DP sync counts it as having no unfinished request) and the other rank keeps
  admitting. Contributing ``len(running)`` froze the other ranks for as long as the pause lasted.
"""

from __future__ import annotations

import time

import pytest

from tests.multiproc.events import Add, Trace, TraceResult, WaitTokens
from tests.multiproc.harness import Cluster
from tests.multiproc.invariants import check_trace

pytestmark = [pytest.mark.timeout(900), pytest.mark.path_independent]

DP, CAP = 2, 4
# More requests than seats on every rank, so that admissions wait and the gate acts.
PER_RANK = 6


@pytest.fixture(scope="module")
def cluster():
    with Cluster(DP, cap=CAP) as running:
        yield running
    assert running.leftover_processes() == []


def add_load(cluster: Cluster, name: str, max_tokens: int = 40) -> None:
    cluster.requests = {}
    cluster.play(
        [Add(r, f"{name}-{r}-{i}", 8, max_tokens) for r in range(DP) for i in range(PER_RANK)]
    )
    cluster.play([WaitTokens(f"{name}-0-0", 3)])


def finish(cluster: Cluster, name: str, started: float) -> TraceResult:
    """Wait for the wave to end; the run's result, engine-aborted requests marked aborted."""
    cluster.wait_until(cluster.wave_ended, f"{name}: the wave to end after resuming")
    for state in cluster.requests.values():
        if str(state.finish_reason).lower().endswith("abort"):
            state.aborted = True
    trace = Trace(name, DP, [])
    return TraceResult(
        trace, dict(cluster.requests), cluster.drain_records(), 1, time.monotonic() - started
    )


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_on_every_rank_keeps_the_ranks_in_lock_step(cluster, mode):
    started = time.monotonic()
    add_load(cluster, f"pause-{mode}")
    cluster.utility_on_ranks(range(DP), "pause_scheduler", mode, what=f"pause {mode}")
    states = cluster.requests.values()
    if mode == "abort":
        assert all(s.finish_reason is not None for s in states), cluster.requests
    else:  # wait drains the running requests, keep keeps them; both keep the waiting ones
        assert any(s.finish_reason is None for s in states), cluster.requests
    cluster.utility_on_ranks(range(DP), "resume_scheduler", what="resume")
    summary = check_trace(finish(cluster, f"pause-{mode}", started))
    assert summary.frozen_steps > 0, summary  # the gate acted in this run


def test_sleep_and_wake_up_on_every_rank_keep_the_ranks_in_lock_step(cluster):
    started = time.monotonic()
    add_load(cluster, "sleep")
    cluster.utility_on_ranks(range(DP), "sleep", 1, "keep", what="sleep")
    assert any(s.finish_reason is None for s in cluster.requests.values())
    cluster.utility_on_ranks(range(DP), "wake_up", None, what="wake up")
    summary = check_trace(finish(cluster, "sleep", started))
    assert summary.frozen_steps > 0, summary


def test_keep_paused_rank_at_the_cap_does_not_freeze_the_other_rank(cluster):
    started = time.monotonic()
    cluster.requests = {}
    # Rank 1 fills its seats with long requests, then is paused alone, keeping them.
    cluster.play([Add(1, f"kept-{i}", 8, 200) for i in range(CAP)])
    cluster.play([WaitTokens(f"kept-{CAP - 1}", 2)])
    paused = cluster.send_utility(1, "pause_scheduler", "keep")
    cluster.sleep(0.5)
    kept_at_pause = [cluster.requests[f"kept-{i}"].tokens for i in range(CAP)]
    # Rank 0 then gets more requests than its seats, short ones: all must be admitted and
    # finish while rank 1 is paused at the cap.
    cluster.play([Add(0, f"open-{i}", 8, 6) for i in range(2 * CAP)])
    cluster.wait_until(
        lambda: all(
            cluster.requests[f"open-{i}"].finish_reason is not None for i in range(2 * CAP)
        ),
        "rank 0's requests to finish while rank 1 is paused",
    )
    kept_tokens = [cluster.requests[f"kept-{i}"].tokens for i in range(CAP)]
    # End the pause as vLLM allows: every rank paused (consensus), then every rank resumed.
    own = cluster.send_utility(0, "pause_scheduler", "keep")
    cluster.utility_results_of({0: own, 1: paused}, "pause keep")
    cluster.utility_on_ranks(range(DP), "resume_scheduler", what="resume")
    result = finish(cluster, "keep-paused-alone", started)
    check_trace(result)
    assert kept_tokens == kept_at_pause  # paused: rank 1 ran none of its requests
    # While rank 0 had requests waiting, rank 1 gathered 0, not its full seats: rank 0 froze
    # only at its own cap.
    schedules = [f for kind, f in result.records[0] if kind == "schedule" and f["waiting"]]
    assert schedules and all(f["queue"][1] == 0 for f in schedules), schedules
    assert all(f["queue"][0] == CAP for f in schedules if f["frozen"]), schedules
