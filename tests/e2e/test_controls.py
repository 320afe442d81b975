"""Lesson A's negative control on the real server (slow: ``nox -s e2e-controls``).

The gather moved into ``schedule()`` must hang the real server (no token for ``CONTROL_STALL_S``
while requests are outstanding), with ``/health`` still answering 200; the hang is attributed
from the engine cores' stacks, the engine core waiting in the gather must have logged the gather
watchdog's ERROR (the default ``balance_gather_warn_s``), and the server is torn down
with nothing left running. The load is a series of wave starts (single requests to an idle
server); the shipped placement serves the same load (tests/e2e/test_server.py, in CI).

Only a real server shows that such a hang is silent to ``/health`` and what the operator's log
and the server's teardown then do; the deadlocks themselves, lessons A and B, and a rank
SIGKILLed mid-load are locked in CI by tests/multiproc (test_deadlocks.py, test_faults.py), and
a SIGKILL under load on a real server by tests/e2e/test_multinode.py. It starts its own server
(~2 min on the 2-core machine), hence not in CI.
"""

from __future__ import annotations

import re

import pytest

from balance_testbed.load import Stall
from balance_testbed.server import VllmServer, engine_core_main_frames
from tests.e2e.runs import MODES, send_waves
from tests.multiproc.watchdog_log import assert_blocked_exactly, watchdog_lines
from vllm_balance.config import DEFAULT_GATHER_WARN_S
from vllm_balance.shim.watchdog import BLOCKED

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# The shipped server streams a token every few tens of ms; the misplaced gather stops every token
# for good at the first wave start.
CONTROL_STALL_S = 30.0
# The control's wave-start load: single requests, one wave each, until the placement hangs
# (it hangs on the first).
CONTROL_WAVES = 10


def engine_core_rank(process_name: str) -> int:
    """``VLLM::EngineCore_DP1 (4242)`` -> 1."""
    match = re.search(r"EngineCore_DP(\d+)", process_name)
    assert match, process_name
    return int(match.group(1))


def assert_gather_watchdog_reported(log: str, in_gather: list[str]) -> None:
    """The engine cores stuck in the gather logged the watchdog's ERROR, the others nothing.

    The control runs with the default ``balance_gather_warn_s`` (what an operator gets) and
    stalls for ``CONTROL_STALL_S``, several times that, before it looks.
    """
    lines = watchdog_lines(log)
    by_rank = {rank: [line for line in lines if line.rank == rank] for rank in (0, 1)}
    assert_blocked_exactly(by_rank, [engine_core_rank(n) for n in in_gather], DEFAULT_GATHER_WARN_S)
    blocked_lines = [text for text in log.splitlines() if BLOCKED in text]
    assert all(" ERROR " in text for text in blocked_lines), blocked_lines[:4]


def test_lesson_a_gather_inside_schedule_hangs_the_real_server_silently(server_runs):
    """A request to an idle server starts a DP wave with one rank busy and the other woken with
    nothing to run, which never enters ``schedule()``, so never reaches the gather there. (The
    48-request burst hangs it only when one rank happens to start with nothing: 1 of 3 runs did
    not, 2026-11-30. See docs/testing.md.)
    """
    server_runs.set_seam(True)  # the shim path, the lesson A placement in its engine cores
    env = {"VLLM_BALANCE_E2E_VARIANT": "lesson_a"}
    server = VllmServer(server_runs.spec(MODES["shim"], env=env), server_runs.workdir / "lesson-a")
    completed: list = []
    with server:
        with pytest.raises(Stall) as stall:
            send_waves(server.base_url, CONTROL_WAVES, CONTROL_STALL_S, completed)
        health_while_hung = server.http_status("/health")
        frames = engine_core_main_frames(server.dump_stacks())
    print(f"lesson_a: wave {len(completed) + 1}: {stall.value}; /health {health_while_hung}")
    print(f"lesson_a: engine cores' frames {frames}")
    assert "NEGATIVE CONTROL lesson_a" in server.log_text()
    assert stall.value.outstanding, "a stall with nothing outstanding is not a hang"
    assert health_while_hung == 200, "the hang is silent: /health keeps answering"
    # Same attribution as the harness: one rank waits in the gather inside schedule(), the
    # idle one in its dummy batch (whose MoE collective the gathering rank never joins).
    in_gather = [n for n, f in frames.items() if "schedule" in f and "balance_gather" in f]
    in_dummy = [n for n, f in frames.items() if "execute_dummy_batch" in f]
    assert in_gather and in_dummy, frames
    assert_gather_watchdog_reported(server.log_text(), in_gather)
    assert server.leftovers() == [], server.stop_report
