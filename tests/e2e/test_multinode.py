"""Multi-node DP: a head node and a ``--headless`` node on two "hosts" (network namespaces).

Each mode's two-host server is started once (``tests/e2e/multinode.py``): the head node's API
server and rank 0 in one namespace, the headless node's rank 1 in the other, joined by a veth
pair; the one-host rows' load through the ``openai`` client from the head's loopback. Every test
is one assertion on that record. Without root or ``ip netns`` every test skips, saying why.

In CI (``nox -s e2e``): the shim row (the tests without ``slow``). ``nox -s e2e-multinode``: all
rows, balance off as the control, and the faults: the headless engine core paused (SIGSTOP,
SIGCONT), then the headless node killed (SIGKILL) under load.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from balance_testbed.server import DPNode
from balance_testbed.server_log import (
    BALANCE_PREFIX,
    activation_lines,
    last_stats_per_rank,
    metric_samples,
    metrics_as_log_lines,
    stats_lines_per_rank,
)
from tests.e2e.multinode import (
    BLOCKED_SLACK_S,
    NODE_ENV,
    RPC_PORT,
    TWO_HOST_MODES,
    frozen_decisions,
)
from tests.e2e.runs import LOAD_REQUESTS, ROOT, WAVES
from tests.e2e.test_laptop_doc import ENV_ASSIGNMENT
from tests.e2e.test_server import PROBLEM_MARKERS, VLLM_RUNNING
from vllm_balance.config import DEFAULT_GATHER_WARN_S, ENABLE_KEY

# The first test of a mode starts its two nodes (start-up <= 600 s, load <= 600 s, faults a
# few minutes, stop <= 60 s).
TIMEOUT = pytest.mark.timeout(3600)
# The shim row is the short case CI runs; the other rows, their comparisons and the faults are
# nox -s e2e-multinode.
ROWS = [
    pytest.param(name, marks=[] if name == "shim" else [pytest.mark.slow])
    for name in TWO_HOST_MODES
]
ON_ROWS = [row for row in ROWS if TWO_HOST_MODES[row.values[0]].path]
FAULT_ROWS = [name for name, mode in TWO_HOST_MODES.items() if mode.faults]
# Slack allowed to balance on over balance off in time-to-failure (noise on 2 cores).
FAULT_SLACK_S = 10.0
# The two hosts of docs/operations.md "Multi-node DP".
DOC_ADDRESSES = ("10.0.0.1", "10.0.0.2")
DOC_HEAD_ADDRESS = DOC_ADDRESSES[0]


@pytest.mark.parametrize("name", ROWS)
@pytest.mark.multinode
@TIMEOUT
def test_every_request_completes_with_its_token_count_across_two_hosts(two_host_runs, name):
    run = two_host_runs.get(name)
    assert run.stall is None
    assert len(run.outcomes) == LOAD_REQUESTS and len(run.wave_outcomes) == WAVES
    wrong = [
        (o.prompt.key, o.error, o.completion_tokens, o.prompt.max_tokens)
        for o in run.outcomes + run.wave_outcomes
        if o.error or o.completion_tokens != o.prompt.max_tokens
    ]
    assert wrong == []


@pytest.mark.parametrize("name", ROWS)
@pytest.mark.multinode
@TIMEOUT
def test_the_dp_group_crosses_the_veth_to_the_other_host(two_host_runs, name):
    """Each engine core's established connections reach the other namespace's address: its
    only links to the other host are its DP group's (the group's store and gloo pairs, which
    the balance gather and vLLM's own all-reduce use)."""
    run = two_host_runs.get(name)
    head, node1 = run.addresses["head"], run.addresses["node1"]
    [dp0] = [peers for title, peers in run.peers.items() if "EngineCore_DP0 on head" in title]
    [dp1] = [peers for title, peers in run.peers.items() if "EngineCore_DP1 on node1" in title]
    assert node1 in dp0, run.peers
    assert head in dp1, run.peers


@pytest.mark.parametrize("name", ON_ROWS)
@pytest.mark.multinode
@TIMEOUT
def test_each_host_activates_balance_for_its_own_rank(two_host_runs, name):
    run = two_host_runs.get(name)
    for rank, node in enumerate(("head", "node1")):
        lines = activation_lines(run.serving_log[node])
        assert [(line["rank"], line["dp"], line["path"]) for line in lines] == [
            (str(rank), "2", run.mode.path)
        ], lines


@pytest.mark.parametrize("name", ON_ROWS)
@pytest.mark.multinode
@TIMEOUT
def test_both_ranks_freeze_on_the_same_steps(two_host_runs, name):
    """The gate reads one gathered vector on every rank: for each gather both ranks' steps read,
    they decided alike (step records keyed by the gather number, which is the same collective on
    every rank), and they froze together."""
    run = two_host_runs.get(name)
    decisions = frozen_decisions(run.steps)
    both = {gather: ranks for gather, ranks in decisions.items() if len(ranks) == 2}
    disagreeing = {gather: ranks for gather, ranks in both.items() if ranks[0] != ranks[1]}
    assert disagreeing == {}
    assert sum(ranks[0] for ranks in both.values()) > 0, f"{len(both)} shared steps, none frozen"


@pytest.mark.parametrize("name", ON_ROWS)
@pytest.mark.multinode
@TIMEOUT
def test_gate_froze_admissions_on_both_hosts(two_host_runs, name):
    stats = last_stats_per_rank(two_host_runs.get(name).serving_logs())
    assert sorted(stats) == [0, 1], stats
    assert all(s["frozen_pct"] > 0 for s in stats.values()), stats
    assert sum(s["deferred"] for s in stats.values()) > 0, stats


@pytest.mark.parametrize("name", ON_ROWS)
@pytest.mark.multinode
@TIMEOUT
def test_head_metrics_show_every_rank_as_its_own_log_line(two_host_runs, name):
    """The headless node's rank reaches the head node's /metrics: per engine, the
    counters equal one of the stats lines that rank logged on its own host."""
    run = two_host_runs.get(name)
    assert run.metrics_status == 200
    scraped = metrics_as_log_lines(run.metrics_text)
    lines = stats_lines_per_rank(run.serving_logs())
    assert sorted(scraped) == [0, 1], f"engines on the head's /metrics: {sorted(scraped)}"
    for engine, as_logged in scraped.items():
        assert as_logged["steps"] > 0 and as_logged["deferred"] > 0, (engine, as_logged)
        assert as_logged in lines[engine], (engine, as_logged, lines[engine][-3:])
    ours = {frozenset(s.labels.items()) for s in metric_samples(run.metrics_text, BALANCE_PREFIX)}
    vllms = {frozenset(s.labels.items()) for s in metric_samples(run.metrics_text, VLLM_RUNNING)}
    assert ours == vllms, (ours, vllms)


@pytest.mark.multinode
@pytest.mark.slow
@TIMEOUT
def test_balance_off_on_two_hosts_has_no_balance_metrics(two_host_runs):
    run = two_host_runs.get("off")
    assert metric_samples(run.metrics_text, VLLM_RUNNING)
    assert metric_samples(run.metrics_text, BALANCE_PREFIX) == []


@pytest.mark.parametrize("name", [row.values[0] for row in ON_ROWS])
@pytest.mark.multinode
@pytest.mark.slow
@TIMEOUT
def test_greedy_outputs_on_two_hosts_equal_balance_off(two_host_runs, name):
    off, on = two_host_runs.get("off").texts(), two_host_runs.get(name).texts()
    differing = sorted(key for key in off if off[key] != on.get(key))
    assert differing == [], f"{len(differing)}/{len(off)} texts differ: {differing[:8]}"


@TIMEOUT
def test_two_host_shim_texts_equal_one_host_balance_off(two_host_runs, server_runs):
    """CI's greedy check for the two-host row (the one-host off row is in the same session)."""
    off, on = server_runs.get("off").texts(), two_host_runs.get("shim").texts()
    differing = sorted(key for key in off if off[key] != on.get(key))
    assert differing == [], f"{len(differing)}/{len(off)} texts differ: {differing[:8]}"


@pytest.mark.parametrize("name", ROWS)
@pytest.mark.multinode
@TIMEOUT
def test_start_and_load_log_no_error_on_either_host(two_host_runs, name):
    run = two_host_runs.get(name)
    for node, log in run.serving_log.items():
        problems = [ln for ln in log.splitlines() if any(m in ln for m in PROBLEM_MARKERS)]
        assert problems == [], f"{node}:\n" + "\n".join(problems[:20])


@pytest.mark.multinode
@TIMEOUT
def test_sigterm_stops_both_hosts_and_leaves_nothing(two_host_runs):
    """The operator's stop: SIGTERM to the head node, then to the headless node (whether it
    followed the head by itself is recorded); nothing of either node left, both namespaces
    removed."""
    run = two_host_runs.get("shim")
    for node, report in run.stop_report.items():
        assert report["clean"] and report["killed"] == [], (node, report)
    assert run.leftovers == [] and run.namespaces_left == []


# ----------------------------------------------------------------------------------- faults
@pytest.mark.parametrize("name", FAULT_ROWS)
@pytest.mark.multinode
@pytest.mark.slow
@TIMEOUT
def test_paused_headless_engine_core_every_request_still_completes(two_host_runs, name):
    pause = two_host_runs.get(name).pause
    assert pause["error"] is None, pause["error"]
    outcomes = pause["outcomes"]
    assert len(outcomes) == pause["sent"]
    assert [o["error"] for o in outcomes if o["error"]] == []
    assert all(o["completion_tokens"] == o["prompt"]["max_tokens"] for o in outcomes)


@pytest.mark.multinode
@pytest.mark.slow
@TIMEOUT
def test_paused_headless_engine_core_head_watchdog_errors_within_threshold_then_recovers(
    two_host_runs,
):
    """Balance on: the head's rank waits in the gather for the stopped rank; its watchdog logs
    the ERROR once the wait reaches balance_gather_warn_s, and the recovery after SIGCONT."""
    pause = two_host_runs.get("compat").pause
    final = pause["attempts"][-1]
    assert final["blocked_after_s"] is not None, pause["attempts"]
    assert final["blocked_after_s"] <= DEFAULT_GATHER_WARN_S + BLOCKED_SLACK_S, final
    assert final["unblocked_after_s"] is not None, final
    blocked = [line for line in pause["head_watchdog"] if line["kind"] == "blocked"]
    unblocked = [line for line in pause["head_watchdog"] if line["kind"] == "unblocked"]
    assert {line["rank"] for line in blocked + unblocked} == {0}
    assert DEFAULT_GATHER_WARN_S <= blocked[0]["seconds"] < DEFAULT_GATHER_WARN_S + 1.0
    assert unblocked[-1]["gather"] == blocked[-1]["gather"]
    assert unblocked[-1]["seconds"] >= DEFAULT_GATHER_WARN_S
    assert any("balance gather blocked: DP0" in ln for ln in pause["head_error_lines"])


@pytest.mark.multinode
@pytest.mark.slow
@TIMEOUT
def test_paused_headless_engine_core_balance_off_logs_no_gather_watchdog(two_host_runs):
    pause = two_host_runs.get("off").pause
    assert pause["head_watchdog"] == []


@pytest.mark.parametrize("name", FAULT_ROWS)
@pytest.mark.multinode
@pytest.mark.slow
@TIMEOUT
def test_killed_headless_node_clients_fail_head_exits_nothing_lost_or_left(two_host_runs, name):
    run = two_host_runs.get(name)
    kill = run.kill
    assert kill["load_error"] is None, kill  # no stall: every client got an answer
    assert kill["clients_done_s"] is not None and kill["errors"] > 0, kill
    assert kill["errors"] + kill["completed"] == kill["sent"], kill
    assert kill["silently_short"] == [], kill
    assert kill["head_exit_s"] is not None, kill
    assert run.leftovers == [] and run.namespaces_left == [], (run.leftovers, run.namespaces_left)


@pytest.mark.multinode
@pytest.mark.slow
@TIMEOUT
def test_killed_headless_node_balance_on_fails_no_later_than_off(two_host_runs):
    on, off = two_host_runs.get("compat").kill, two_host_runs.get("off").kill
    print(f"SIGKILL of the headless node: on={on} off={off}")
    assert on["clients_done_s"] <= off["clients_done_s"] + FAULT_SLACK_S, (on, off)


# ----------------------------------------------------------------------------------- the docs
def documented_bash(pattern: str) -> str:
    """The one line of docs/operations.md's ```bash blocks that matches ``pattern``.

    (Only ```bash fences: the ```text blocks around them hold log lines, not commands.)
    """
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    lines = "".join(blocks).replace("\\\n", " ").splitlines()
    (command,) = [line for line in lines if re.search(pattern, line)]
    return command


def flag_values(words: list[str]) -> dict[str, str | bool]:
    """``--flag value`` pairs of a command line; a flag with no value is True."""
    values: dict[str, str | bool] = {}
    for index, word in enumerate(words):
        if word.startswith("--"):
            following = words[index + 1] if index + 1 < len(words) else "--"
            values[word] = True if following.startswith("--") else following
    return values


@pytest.mark.parametrize(
    "rank,pattern", [(0, r"vllm serve .*--api-server-count"), (1, "--headless")]
)
@pytest.mark.multinode
def test_operations_multinode_commands_carry_the_tested_flags(rank, pattern):
    """docs/operations.md "Multi-node DP": each host's command has the multi-node flags and the
    environment the two-host test runs that host with (with the doc's addresses)."""
    words = shlex.split(documented_bash(pattern))
    env = {}
    while ENV_ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    flags = flag_values(words)
    node = DPNode(address=DOC_HEAD_ADDRESS, rpc_port=RPC_PORT, start_rank=rank)
    assert flag_values(node.args()).items() <= flags.items()
    assert flags["--data-parallel-size"] == "2"
    assert env["VLLM_HOST_IP"] == DOC_ADDRESSES[rank] and set(env) == set(NODE_ENV)
    assert json.loads(flags["--additional-config"]) == {ENABLE_KEY: True}
