"""Balance behind several API servers: external, multi-port external and hybrid DP load balancing.

Each shape's processes are started once (``tests/e2e/lb.py``), every API server on loopback, and
the 48 requests are spread over them as an external load balancer would. The gather runs on the
one DP group whichever API server admitted a request: every rank freezes on the same steps, and
each API server's ``/metrics`` has the engines behind it only (docs/operations.md, "DP deployment
shapes": scrape every API server).

In CI (``nox -s e2e``): the external row. ``nox -s e2e-shapes``: the multi-port row (and the Ray
backend, tests/e2e/test_ray.py); ``nox -s e2e-shapes -- -m shapes`` adds hybrid LB at DP=4 (four
engine cores on one machine).
"""

from __future__ import annotations

import pytest

from balance_testbed.server_log import (
    BALANCE_PREFIX,
    activation_lines,
    balance_metrics_per_engine,
    metric_samples,
)
from tests.e2e.lb import LB_SHAPES
from tests.e2e.multinode import frozen_decisions
from tests.e2e.runs import LOAD_REQUESTS
from tests.e2e.test_server import PROBLEM_MARKERS, VLLM_RUNNING

pytestmark = pytest.mark.timeout(2400)
# external: CI; multi-port: on demand; hybrid (DP=4): on demand, named (-m shapes).
MARKS = {
    "external": [],
    "multi-port": [pytest.mark.slow, pytest.mark.shapes],
    "hybrid": [pytest.mark.slow, pytest.mark.shapes, pytest.mark.hybrid],
}
ROWS = [pytest.param(name, marks=MARKS[name]) for name in LB_SHAPES]


@pytest.fixture(scope="module")
def lb_runs(tiny_model, tmp_path_factory):
    from tests.e2e.lb import LBRunCache

    cache = LBRunCache(tiny_model, tmp_path_factory.mktemp("lb"))
    yield cache
    cache.close()


@pytest.mark.parametrize("name", ROWS)
def test_every_request_through_every_api_server_completes(lb_runs, name):
    run = lb_runs.get(name)
    assert run.stall is None, run.stall
    assert len(run.outcomes) == LOAD_REQUESTS
    wrong = [
        (o.prompt.key, o.error, o.completion_tokens, o.prompt.max_tokens)
        for o in run.outcomes
        if o.error or o.completion_tokens != o.prompt.max_tokens
    ]
    assert wrong == []
    assert set(run.health.values()) == {200}, run.health


@pytest.mark.parametrize("name", ROWS)
def test_each_engine_logs_its_activation_with_its_rank(lb_runs, name):
    run = lb_runs.get(name)
    lines = activation_lines(run.serving_log)
    dp = str(run.mode.dp_size)
    assert sorted((line["rank"], line["dp"]) for line in lines) == [
        (str(rank), dp) for rank in range(run.mode.dp_size)
    ], lines


@pytest.mark.parametrize("name", ROWS)
def test_every_rank_freezes_on_the_same_steps(lb_runs, name):
    run = lb_runs.get(name)
    everyone = {
        gather: ranks
        for gather, ranks in frozen_decisions(run.steps).items()
        if len(ranks) == run.mode.dp_size
    }
    disagreeing = {
        gather: ranks for gather, ranks in everyone.items() if len(set(ranks.values())) > 1
    }
    assert disagreeing == {}
    frozen = sum(next(iter(ranks.values())) for ranks in everyone.values())
    assert frozen > 0, f"{len(everyone)} steps every rank read, none frozen"


@pytest.mark.parametrize("name", ROWS)
def test_each_api_servers_metrics_are_its_own_engines(lb_runs, name):
    run = lb_runs.get(name)
    for port, ranks in run.ports.items():
        text = run.metrics_text[port]
        balance = balance_metrics_per_engine(text)
        assert sorted(balance) == ranks, (port, sorted(balance))
        assert all(values["steps_total"] > 0 for values in balance.values()), balance
        vllms = {int(s.labels["engine"]) for s in metric_samples(text, VLLM_RUNNING)}
        assert vllms == set(ranks), (port, vllms)
        assert {int(s.labels["engine"]) for s in metric_samples(text, BALANCE_PREFIX)} == vllms


@pytest.mark.parametrize("name", ROWS)
def test_greedy_outputs_equal_one_host_balance_off(lb_runs, server_runs, name):
    on = lb_runs.get(name).texts()
    off = server_runs.get("off").texts()
    differing = sorted(key for key in off if off[key] != on.get(key))
    assert differing == [], f"{len(differing)}/{len(off)} texts differ: {differing[:8]}"


@pytest.mark.parametrize("name", ROWS)
def test_start_load_and_stop_log_no_error_and_leave_nothing(lb_runs, name):
    run = lb_runs.get(name)
    problems = [ln for ln in run.serving_log.splitlines() if any(m in ln for m in PROBLEM_MARKERS)]
    assert problems == [], "\n".join(problems[:20])
    for index, report in run.stop_report.items():
        assert report["clean"] and report["killed"] == [], (index, report)
    assert run.leftovers == []
