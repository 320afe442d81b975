"""Negative controls and faults on the real server (slow: ``nox -s e2e-controls``).

- Lesson A: the gather moved into ``schedule()`` must hang the real server (no token for
  ``CONTROL_STALL_S`` while requests are outstanding), with ``/health`` still answering 200 (so
  only a token watchdog sees it); the hang is attributed from the engine cores' stacks and the
  server is torn down with nothing left running. The shipped placement serves the same load.
- Fault: SIGKILL one engine core mid-load, balance off and on side by side: clients get errors,
  not a hang, within ``FAULT_WINDOW_S``; the server exits or reports unhealthy; nothing is left.

Each control starts its own server (~2 min each on the 2-core machine), hence not in CI.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.load import BackgroundLoad, Stall, make_prompts, send_concurrently
from tests.e2e.runs import LOAD_REQUESTS, MODES, ROOT
from tests.e2e.server import VllmServer, engine_core_main_frames

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# The shipped server streams a token every few tens of ms under this load; lesson A stops every
# token for good within ~1 s of one rank draining.
CONTROL_STALL_S = 30.0
# Survivors and the front end notice a dead engine core within seconds (measured 3-10 s).
FAULT_WINDOW_S = 60.0
# Lesson B's wave-start load: single requests, one wave each, until the placement hangs.
LESSON_B_WAVES = 10
# Slack allowed to balance on over balance off in time-to-failure (noise on 2 cores).
FAULT_SLACK_S = 10.0


def control_server(server_runs, name: str, variant: str | None) -> VllmServer:
    """A shim-path server (seam applied) with the given gather placement variant."""
    server_runs.set_seam(True)
    env = {"VLLM_BALANCE_E2E_VARIANT": variant, "PYTHONPATH": str(ROOT)} if variant else {}
    spec = server_runs.spec(MODES["shim"], env=env)
    return VllmServer(spec, server_runs.workdir / name)


def test_lesson_a_gather_inside_schedule_hangs_the_real_server_silently(server_runs):
    server = control_server(server_runs, "lesson-a", "lesson_a")
    with server:
        with pytest.raises(Stall) as stall:
            send_concurrently(server.base_url, make_prompts(LOAD_REQUESTS), stall_s=CONTROL_STALL_S)
        health_while_hung = server.http_status("/health")
        frames = engine_core_main_frames(server.dump_stacks())
    print(f"lesson A: {stall.value}; /health {health_while_hung}; frames {frames}")
    assert "NEGATIVE CONTROL lesson_a" in server.log_text()
    assert stall.value.outstanding, "a stall with nothing outstanding is not a hang"
    assert health_while_hung == 200, "lesson A is silent: /health keeps answering"
    # Same attribution as the harness: one rank waits in the gather inside schedule(), the
    # drained one in its dummy batch (whose MoE collective the gathering rank never joins).
    in_gather = [n for n, f in frames.items() if "schedule" in f and "balance_gather" in f]
    in_dummy = [n for n, f in frames.items() if "execute_dummy_batch" in f]
    assert in_gather and in_dummy, frames
    assert server.leftovers() == [], server.stop_report


def test_lesson_b_gather_inside_process_engine_step_hangs_the_real_server(server_runs):
    """Lesson B: a rank with nothing to run reaches the gather before its dummy forward.

    The designated load is a wave start: one request to an idle server, so one rank steps its
    model while the other, woken by START_DP_WAVE, has nothing to run. (The 48-request burst
    does not hang this placement: measured, both ranks stay busy to the end, see docs/e2e.md.)
    Waves are sent one at a time, each after the previous finished, up to ``LESSON_B_WAVES``.
    """
    server = control_server(server_runs, "lesson-b", "lesson_b")
    waves = 0
    with server:
        with pytest.raises(Stall) as stall:
            for prompt in make_prompts(LESSON_B_WAVES, seed=2):
                waves += 1
                send_concurrently(server.base_url, [prompt], stall_s=CONTROL_STALL_S)
        health_while_hung = server.http_status("/health")
        frames = engine_core_main_frames(server.dump_stacks())
    print(f"lesson B: wave {waves}: {stall.value}; /health {health_while_hung}; frames {frames}")
    assert "NEGATIVE CONTROL lesson_b" in server.log_text()
    assert stall.value.outstanding and health_while_hung == 200
    in_gather = [
        n for n, f in frames.items() if "_process_engine_step" in f and "balance_gather" in f
    ]
    # The busy rank waits for its forward's result (future.result() in EngineCore.step): its
    # worker sits in the MoE collective that the gathering rank's dummy forward never joins.
    in_forward = [n for n, f in frames.items() if "step" in f and "result" in f]
    assert in_gather and in_forward, frames
    assert server.leftovers() == [], server.stop_report


def test_shipped_placement_serves_the_control_load(server_runs):
    """The counterpart of lesson A: same prompts, same watchdog, the gather where it ships."""
    run = server_runs.get("shim")
    assert run.stall is None
    assert all(o.error is None and o.completion_tokens == o.prompt.max_tokens for o in run.outcomes)


def kill_engine_core_under_load(server_runs, mode_name: str) -> dict:
    """SIGKILL EngineCore_DP1 once tokens flow; what the clients and the server did after."""
    mode = MODES[mode_name]
    server_runs.set_seam(mode.seam)
    server = VllmServer(server_runs.spec(mode), server_runs.workdir / f"kill-{mode_name}")
    long_prompts = make_prompts(16, seed=1, min_tokens=150, max_tokens=200)
    with server:
        load = BackgroundLoad(server.base_url, long_prompts, stall_s=FAULT_WINDOW_S * 2)
        load.start()
        assert load.wait_for_tokens(64, timeout_s=300), "no tokens before the kill"
        [victim] = server.pids_named("VLLM::EngineCore_DP1")
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        load.join(timeout=FAULT_WINDOW_S)
        clients_done_s = None if load.is_alive() else load.progress.last_finished - killed_at
        server_exit_s = unhealthy_s = None
        while time.monotonic() - killed_at < FAULT_WINDOW_S and server_exit_s is None:
            if server.process.poll() is not None:
                server_exit_s = time.monotonic() - killed_at
            elif unhealthy_s is None and server.http_status("/health", timeout_s=2) != 200:
                unhealthy_s = time.monotonic() - killed_at
            time.sleep(0.25)
    return {
        "clients_done_s": clients_done_s,
        "errors": sum(o.error is not None for o in load.outcomes or []),
        "completed": sum(o.error is None for o in load.outcomes or []),
        "unhealthy_s": unhealthy_s,
        "server_exit_s": server_exit_s,
        "stop": server.stop_report,
        "leftovers": server.leftovers(),
    }


def _failed_fast(report: dict) -> bool:
    return (
        report["clients_done_s"] is not None
        and report["errors"] > 0
        and (report["server_exit_s"] is not None or report["unhealthy_s"] is not None)
        and report["leftovers"] == []
    )


def test_sigkill_engine_core_mid_load_balance_on_fails_like_off(server_runs):
    off = kill_engine_core_under_load(server_runs, "off")
    on = kill_engine_core_under_load(server_runs, "shim")
    print(f"SIGKILL EngineCore_DP1 mid-load: off={off} on={on}")
    assert _failed_fast(off), off
    assert _failed_fast(on), on
    assert on["clients_done_s"] <= off["clients_done_s"] + FAULT_SLACK_S, (off, on)
