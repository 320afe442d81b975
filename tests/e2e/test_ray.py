"""Balance on vLLM's Ray DP backend: the real DP=2 server, engine cores as Ray actors.

Each mode's server runs once on its own local Ray cluster (``tests/e2e/ray_backend.py``), with
the one-host rows' load. Without the Ray activation (``vllm_balance.ray_actor``) balance is
silently absent there: no activation line, no frozen step, no counters. On demand only (a Ray
cluster and two server starts): ``nox -s e2e-shapes``. The actor class as constructed is
checked in every test session: ``tests/test_ray_actor.py``.
"""

from __future__ import annotations

import pytest

from balance_testbed.server_log import (
    activation_lines,
    balance_metrics_per_engine,
    last_stats_per_rank,
    metric_samples,
    metrics_as_log_lines,
    stats_lines_per_rank,
)
from tests.e2e.multinode import frozen_decisions
from tests.e2e.runs import LOAD_REQUESTS, WAVES
from tests.e2e.test_server import PROBLEM_MARKERS, VLLM_RUNNING

pytestmark = [pytest.mark.timeout(2400), pytest.mark.slow, pytest.mark.shapes, pytest.mark.ray]
MODES = ["ray-off", "ray-on"]
# The API server's warning for an engine whose stats carry no balance counters.
NO_COUNTERS = "has sent vLLM's stats for"


@pytest.fixture(scope="module")
def ray_runs(tiny_model, tmp_path_factory):
    from tests.e2e.ray_backend import RayRunCache

    cache = RayRunCache(tiny_model, tmp_path_factory.mktemp("ray"))
    yield cache
    cache.close()


@pytest.mark.parametrize("mode", MODES)
def test_every_request_completes_on_the_ray_backend(ray_runs, mode):
    run = ray_runs.get(mode)
    assert run.stall is None, run.stall
    assert len(run.outcomes) == LOAD_REQUESTS and len(run.wave_outcomes) == WAVES
    wrong = [
        (o.prompt.key, o.error, o.completion_tokens, o.prompt.max_tokens)
        for o in run.outcomes + run.wave_outcomes
        if o.error or o.completion_tokens != o.prompt.max_tokens
    ]
    assert wrong == []
    assert (run.health_status, run.metrics_status) == (200, 200)


def test_each_ray_actor_activates_balance_for_its_rank(ray_runs):
    lines = activation_lines(ray_runs.get("ray-on").log)
    assert sorted((line["rank"], line["dp"]) for line in lines) == [("0", "2"), ("1", "2")], lines
    assert {line["engine_core"] for line in lines} == {"BalanceDPMoEEngineCoreActor"}
    assert {line["scheduler"] for line in lines} == {"BalanceScheduler"}


def test_ray_balance_off_activates_nothing(ray_runs):
    run = ray_runs.get("ray-off")
    assert activation_lines(run.log) == [] and last_stats_per_rank(run.log) == {}
    assert metric_samples(run.metrics_text, "vllm:balance_") == []
    assert "BalanceDPMoEEngineCoreActor" not in run.log  # vLLM's own actor class


def test_ray_ranks_freeze_together_and_defer_admissions(ray_runs):
    run = ray_runs.get("ray-on")
    stats = last_stats_per_rank(run.log)
    assert sorted(stats) == [0, 1], stats
    assert all(s["frozen_pct"] > 0 for s in stats.values()), stats
    assert sum(s["deferred"] for s in stats.values()) > 0, stats
    both = {g: r for g, r in frozen_decisions(run.steps).items() if len(r) == 2}
    assert both and all(r[0] == r[1] for r in both.values()), both
    assert any(r[0] for r in both.values()), f"{len(both)} shared steps, none frozen"


def test_ray_metrics_count_each_rank_as_its_log_line_does(ray_runs):
    run = ray_runs.get("ray-on")
    scraped = balance_metrics_per_engine(run.metrics_text)
    assert sorted(scraped) == [0, 1], scraped
    assert all(v["frozen_steps_total"] > 0 and v["gathers_total"] > 0 for v in scraped.values())
    lines = stats_lines_per_rank(run.serving_log)
    for engine, as_logged in metrics_as_log_lines(run.metrics_text).items():
        assert as_logged in lines[engine], (as_logged, lines[engine][-3:])
    ours = {frozenset(s.labels.items()) for s in metric_samples(run.metrics_text, "vllm:balance_")}
    vllms = {frozenset(s.labels.items()) for s in metric_samples(run.metrics_text, VLLM_RUNNING)}
    assert ours == vllms, (ours, vllms)
    assert NO_COUNTERS not in run.log


def test_ray_greedy_outputs_equal_balance_off(ray_runs):
    off, on = ray_runs.get("ray-off").texts(), ray_runs.get("ray-on").texts()
    differing = sorted(key for key in off if off[key] != on.get(key))
    assert differing == [], f"{len(differing)}/{len(off)} texts differ: {differing[:8]}"


@pytest.mark.parametrize("mode", MODES)
def test_ray_server_and_cluster_stop_by_pid_and_leave_nothing(ray_runs, mode):
    run = ray_runs.get(mode)
    problems = [ln for ln in run.serving_log.splitlines() if any(m in ln for m in PROBLEM_MARKERS)]
    assert problems == [], "\n".join(problems[:20])
    assert run.leftovers == [] and run.ray_leftovers == [], (run.leftovers, run.ray_leftovers)
    assert run.ray_address.startswith("127.0.0.1:"), run.ray_address
