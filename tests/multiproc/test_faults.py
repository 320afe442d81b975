"""SIGKILL one rank mid-run: balance must leave the survivors no worse off than upstream's loop.

What survivors do is measured, not assumed (numbers in docs/deadlocks.md): the same scenario runs
against upstream's own DP loop with balance off (``baseline``) and with the shipped hook
(``balance``). "Worse" would be a survivor that upstream lets fail loudly (exit, ENGINE_CORE_DEAD
to the front end) but that balance leaves hanging, or a slower failure.
"""

from __future__ import annotations

import pytest

from tests.multiproc.harness import Add, Cluster, Kill, Trace, WaitTokens
from tests.multiproc.standin import FORWARD_SECONDS_ENV

pytestmark = pytest.mark.timeout(900)

# Survivors of a peer's death fail within ~1 s when gloo sees the closed connection; the window
# leaves room for a loaded machine and for the SIGTERM-less exit path.
WINDOW_SECONDS = 20.0
# Slack allowed to balance over baseline in time-to-exit (scheduling noise on 2 cores).
SLACK_SECONDS = 5.0


def kill_scenario(mode: str, dp: int, victim: int, idle: bool) -> tuple[dict, int]:
    """Run one kill scenario; returns (per-survivor report, ENGINE_CORE_DEAD messages seen)."""
    # Each forward sleeps a little so the kill lands while ranks are mid-step.
    cluster = Cluster(dp, mode=mode, extra_env={FORWARD_SECONDS_ENV: "0.005"})
    with cluster:
        if idle:
            # One complete wave, then every rank is paused in _process_input_queue().
            cluster.run_trace(Trace("warm-up", dp, [Add(r, f"warm-{r}", 8, 3) for r in range(dp)]))
            cluster.play([Kill(victim), Add((victim + 1) % dp, "after-kill", 8, 4)])
        else:
            cluster.play([Add(r, f"long-{r}", 8, 1000) for r in range(dp)])
            cluster.play([WaitTokens("long-0", 10), Kill(victim)])
        report = cluster.observe_survivors(WINDOW_SECONDS)
        dead_messages = cluster.dead_messages
    assert cluster.leftover_processes() == []
    return report, dead_messages


def _outcome(report: dict) -> list[str]:
    return ["exited" if r["exited_after"] is not None else "alive" for r in report.values()]


def assert_balance_no_worse(dp: int, victim: int, idle: bool) -> tuple[dict, dict]:
    baseline, baseline_dead = kill_scenario("baseline", dp, victim, idle)
    balance, balance_dead = kill_scenario("balance", dp, victim, idle)
    for rank in baseline:
        before, after = baseline[rank], balance[rank]
        if before["exited_after"] is not None:
            assert after["exited_after"] is not None, (rank, "balance hangs where upstream fails")
            assert after["exited_after"] <= before["exited_after"] + SLACK_SECONDS, (rank, after)
    assert balance_dead >= baseline_dead
    return baseline, balance


def test_killed_rank_mid_decode_survivors_fail_as_upstream():
    assert_balance_no_worse(dp=2, victim=1, idle=False)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 2])
@pytest.mark.parametrize("idle", [False, True], ids=["mid_decode", "between_waves"])
def test_killed_rank_dp3_survivors_fail_as_upstream(victim, idle):
    assert_balance_no_worse(dp=3, victim=victim, idle=idle)
