"""The real server, end to end: balance off, on via the shim, on without it (DP=2, tiny MoE).

Each mode's server is started once (``tests/e2e/runs.py``) as an operator would: OpenAI API
server, real DP coordinator and load balancer, two engine cores and their workers, a real MoE
forward whose DP collectives interleave with the balance gather. 48 concurrent streamed
requests (completions and chat, greedy) go through the ``openai`` client; every test below is
one assertion on that run's record.
"""

from __future__ import annotations

import pytest

from balance_testbed.server_log import (
    BALANCE_PREFIX,
    activation_lines,
    balance_metrics_per_engine,
    last_stats_per_rank,
    metric_samples,
    metrics_as_log_lines,
    stats_lines_per_rank,
)
from tests.e2e.runs import LOAD_REQUESTS, MODES, WAVES

# The first test of a mode starts its server (bounded: start-up 600 s, load 600 s, stop 60 s).
pytestmark = pytest.mark.timeout(1800)

ALL = list(MODES)
ON = [name for name, mode in MODES.items() if mode.path]
# A healthy start and load log none of these. (Shutdown is not checked for them: on SIGTERM
# vLLM force-kills the engine cores at once, and the front end's output handler sometimes logs
# EngineDeadError with a traceback before it is cancelled: upstream's own shutdown race.)
# vLLM's own per-engine gauge, labelled model_name and engine.
VLLM_RUNNING = "vllm:num_requests_running"
PROBLEM_MARKERS = ("Traceback (most recent call last)", " ERROR ", "Fatal Python error")


@pytest.mark.parametrize("mode", ALL)
def test_every_request_completes_with_the_requested_token_count(server_runs, mode):
    run = server_runs.get(mode)
    assert run.stall is None
    outcomes = run.outcomes
    assert len(outcomes) == LOAD_REQUESTS
    kinds = {o.prompt.kind for o in outcomes}
    assert kinds == {"completion", "chat"}
    wrong = [
        (o.prompt.key, o.error, o.completion_tokens, o.prompt.max_tokens, o.finish_reason)
        for o in outcomes
        if o.error or o.completion_tokens != o.prompt.max_tokens or o.finish_reason != "length"
    ]
    assert wrong == []


@pytest.mark.parametrize("mode", ALL)
def test_single_request_waves_complete(server_runs, mode):
    """A request to an idle server starts a DP wave with one rank busy and one woken idle: the
    load on which a misplaced gather (lessons A and B) hangs at once."""
    outcomes = server_runs.get(mode).wave_outcomes
    assert [(o.error, o.completion_tokens) for o in outcomes] == [
        (None, o.prompt.max_tokens) for o in outcomes
    ]
    assert len(outcomes) == WAVES


@pytest.mark.parametrize("mode", ON)
def test_log_names_the_activated_path_scheduler_and_engine_core(server_runs, mode):
    run = server_runs.get(mode)
    lines = activation_lines(run.log)
    # One line per engine-core process (DP=2), each naming what this mode must run.
    assert [(line["dp"], line["path"]) for line in lines] == [("2", run.mode.path)] * 2, lines
    assert sorted(line["rank"] for line in lines) == ["0", "1"], lines  # each names its rank
    assert {line["scheduler"] for line in lines} == {
        "BalanceScheduler" if mode == "shim" else "PauseStateBalanceScheduler"
    }
    assert {line["engine_core"] for line in lines} == {"BalanceDPEngineCoreProc"}


def test_balance_off_logs_no_activation_and_no_stats(server_runs):
    log = server_runs.get("off").log
    assert activation_lines(log) == [] and last_stats_per_rank(log) == {}


@pytest.mark.parametrize("mode", ON)
def test_gate_froze_admission_and_deferred_waiting_requests(server_runs, mode):
    stats = last_stats_per_rank(server_runs.get(mode).log)
    assert sorted(stats) == [0, 1], stats
    # The gate freezes every rank on the same gathered vector, so both ranks saw frozen steps.
    assert all(s["frozen_pct"] > 0 for s in stats.values()), stats
    assert sum(s["deferred"] for s in stats.values()) > 0, stats


@pytest.mark.parametrize("mode", ALL)
def test_health_and_metrics_answer_after_the_load(server_runs, mode):
    run = server_runs.get(mode)
    assert (run.health_status, run.metrics_status) == (200, 200)
    assert "vllm:num_requests_running" in run.metrics_text


@pytest.mark.parametrize("mode", ON)
def test_metrics_count_each_rank_as_its_log_line_does(server_runs, mode):
    """/metrics after the load: per engine, the counters of one of that rank's log lines."""
    run = server_runs.get(mode)
    assert "balance metrics sent to the API server's /metrics" in run.log
    scraped = balance_metrics_per_engine(run.metrics_text)
    lines = stats_lines_per_rank(run.serving_log)
    assert sorted(scraped) == [0, 1], scraped
    for values in scraped.values():
        assert values["steps_total"] > 0 and values["frozen_steps_total"] > 0, values
        assert values["deferred_admissions_total"] > 0, values
        assert values["gathers_total"] > 0 and values["gather_seconds_total"] > 0, values
        assert "running_gap" in values, values
    for engine, as_logged in metrics_as_log_lines(run.metrics_text).items():
        assert as_logged in lines[engine], (as_logged, lines[engine][-3:])


@pytest.mark.parametrize("mode", ON)
def test_balance_metrics_carry_vllms_per_engine_labels(server_runs, mode):
    text = server_runs.get(mode).metrics_text
    ours = {frozenset(s.labels.items()) for s in metric_samples(text, BALANCE_PREFIX)}
    vllms = {frozenset(s.labels.items()) for s in metric_samples(text, VLLM_RUNNING)}
    assert ours and ours == vllms, (ours, vllms)


def test_balance_off_exports_no_balance_metrics(server_runs):
    text = server_runs.get("off").metrics_text
    assert metric_samples(text, VLLM_RUNNING)
    assert metric_samples(text, BALANCE_PREFIX) == []


@pytest.mark.parametrize("mode", ON)
def test_greedy_outputs_equal_balance_off(server_runs, mode):
    """Output preservation: balance changes when a request is admitted, never what it says."""
    off, on = server_runs.get("off").texts(), server_runs.get(mode).texts()
    differing = sorted(key for key in off if off[key] != on.get(key))
    assert differing == [], f"{len(differing)}/{len(off)} texts differ: {differing[:8]}"


@pytest.mark.parametrize("mode", ALL)
def test_start_and_load_log_no_error_or_traceback(server_runs, mode):
    log = server_runs.get(mode).serving_log
    problems = [ln for ln in log.splitlines() if any(m in ln for m in PROBLEM_MARKERS)]
    assert problems == [], "\n".join(problems[:20])


@pytest.mark.parametrize("mode", ALL)
def test_sigterm_stops_the_server_cleanly_and_leaves_no_process(server_runs, mode):
    run = server_runs.get(mode)
    assert run.stop_report["clean"] and run.stop_report["killed"] == [], run.stop_report
    assert run.leftovers == []
