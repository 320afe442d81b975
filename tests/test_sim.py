"""The simulator's promises: reproducible output, readable plots, clear trace errors, and a
contract gate that holds in simulation.

The gate checks compare what the product's schedulers did (admissions, ``admission_frozen``,
``BalanceStats``) with the running counts the simulator logged; values the simulator writes
itself (the gathered vector, one gather per step) are not re-checked here. The real gather is
contract 3 (tests/test_contract.py) and the multi-process harness.

Every run here drives the installed vLLM's real schedulers on a tiny scenario (DP 4, cap 4).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

import pytest

from balance_sim.runner import SimOptions, build_workload, run_policy
from balance_sim.stepmodel import RankWork, StepTimeModel
from balance_sim.workload import Arrival, TraceError, load_trace

pytestmark = pytest.mark.path_independent

ALL_POLICIES = ("off", "on", "cap-1", "vllm-cadence:2", "trtllm-adp:50:10", "bounded-hold:3")

TINY = SimOptions(
    dp_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=512,
    num_requests=48,
    rate_per_s=400.0,  # well above capacity: ranks reach the cap and the gate has work to do
    prompt_len="uniform:16:96",
    output_len="uniform:2:24",
    policies=ALL_POLICIES,
    seed=7,
    # The step model before shared expert work and the gather's cost (every rank's work its own,
    # the gather free): the byte-for-byte test below pins that these keys at 0 reproduce it.
    step_model=StepTimeModel(shared_fraction=0.0, gather_ms=0.0),
)

# sha256 of TINY's "policies" section (json.dumps(indent=1, sort_keys=True)) as the simulator
# wrote it before shared_fraction and gather_ms existed (commit e13c59c); the same at vLLM
# 0.24.0, 0.25.0, 0.30.0 and 0.33.0, compat and shim path.
PRE_SHARED_FRACTION_POLICIES_SHA256 = (
    "6f6042a84bf9fcce5287e771f029dcbacb828d3363d9379f0c6c73b48dcc5b8a"
)


@pytest.fixture(scope="module")
def tiny_workload():
    return build_workload(TINY)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    from balance_sim.__main__ import simulate

    out = tmp_path_factory.mktemp("sim")
    runs = simulate(TINY, out, plots=True, progress=False)
    return out, runs


def test_same_seed_gives_byte_identical_json(tiny_runs, tmp_path):
    from balance_sim.__main__ import simulate

    first_dir, _ = tiny_runs
    simulate(TINY, tmp_path, plots=False, progress=False)
    assert (tmp_path / "sim.json").read_bytes() == (first_dir / "sim.json").read_bytes()


def test_shared_fraction_0_and_free_gather_reproduce_the_earlier_numbers_byte_for_byte(tiny_runs):
    out, _ = tiny_runs
    policies = json.loads((out / "sim.json").read_text())["policies"]
    text = json.dumps(policies, indent=1, sort_keys=True)
    assert hashlib.sha256(text.encode()).hexdigest() == PRE_SHARED_FRACTION_POLICIES_SHA256


def test_runs_in_parallel_processes_give_the_same_json_as_in_this_process(tiny_runs, tmp_path):
    from balance_sim.__main__ import simulate

    first_dir, _ = tiny_runs
    two = dataclasses.replace(TINY, policies=("off", "on"))
    simulate(two, tmp_path, plots=False, progress=False, jobs=2)
    parallel = json.loads((tmp_path / "sim.json").read_text())["policies"]
    serial = json.loads((first_dir / "sim.json").read_text())["policies"]
    assert parallel == {policy: serial[policy] for policy in ("off", "on")}


def test_json_holds_every_policy_and_no_wall_clock(tiny_runs):
    out, _ = tiny_runs
    document = json.loads((out / "sim.json").read_text())
    assert list(document["policies"]) == sorted(ALL_POLICIES)
    assert "wall" not in json.dumps(document)


def test_every_policy_completes_every_request(tiny_runs):
    _, runs = tiny_runs
    for run in runs:
        assert run.summary.completed == run.summary.submitted == TINY.num_requests, run.summary


def test_pngs_open_and_the_running_plot_has_one_line_per_rank(tiny_runs):
    from PIL import Image

    from balance_sim.report import running_figure

    out, runs = tiny_runs
    for name in ("running_per_rank.png", "ttft_cdf.png", "tpot_cdf.png"):
        with Image.open(out / name) as image:
            image.verify()
            assert image.size[0] > 300 and image.size[1] > 200
    figure = running_figure([(run.record, run.summary) for run in runs])
    assert len(figure.axes) == len(ALL_POLICIES)
    for ax in figure.axes:
        rank_lines = [line for line in ax.get_lines() if line.get_label().startswith("rank ")]
        assert [line.get_label() for line in rank_lines] == [f"rank {r}" for r in range(4)]


def test_bad_trace_line_names_file_line_and_field(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"arrival_time": 0.0, "prompt_len": 10, "output_len": 5}\n'
        "\n"
        '{"arrival_time": 0.5, "prompt_len": "ten", "output_len": 5}\n'
    )
    with pytest.raises(TraceError) as excinfo:
        load_trace(trace)
    message = str(excinfo.value)
    assert f"{trace}:3:" in message and "'prompt_len'" in message and "'ten'" in message


@pytest.mark.parametrize(
    "line, expected",
    [
        ("not json", "not valid JSON"),
        ('{"arrival_time": 1.0, "prompt_len": 3}', "field 'output_len' is missing"),
        ('{"arrival_time": -1, "prompt_len": 3, "output_len": 2}', "field 'arrival_time'"),
        ("[1, 2, 3]", "expected an object"),
    ],
)
def test_bad_trace_line_errors(tmp_path, line, expected):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(line + "\n")
    with pytest.raises(TraceError, match=expected) as excinfo:
        load_trace(trace)
    assert str(excinfo.value).startswith(f"{trace}:1:")


def test_cli_reports_a_bad_trace_without_traceback(tmp_path, capsys):
    from balance_sim.__main__ import main

    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"arrival_time": 0, "prompt_len": 0, "output_len": 1}\n')
    assert main(["--trace", str(trace), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    assert f"{trace}:1: field 'prompt_len' must be an integer >= 1" in capsys.readouterr().err


def _leader_was_at_cap(run) -> list[bool]:
    """Per step: some rank ended the previous step at the cap (a wave starts with none running)."""
    previous_running = [[0] * TINY.dp_size] + run.record.log.running[:-1]
    return [max(row) == TINY.max_num_seqs for row in previous_running]


def _admissions_while_leader_at_cap(run) -> tuple[int, int]:
    """(steps whose gate input had a rank at the cap, admissions made on those steps)."""
    at_cap = [i for i, flag in enumerate(_leader_was_at_cap(run)) if flag]
    return len(at_cap), sum(sum(run.record.log.admitted[i]) for i in at_cap)


def test_contract_gate_never_admits_while_some_rank_was_at_the_cap(tiny_runs):
    _, runs = tiny_runs
    by_policy = {run.summary.policy: run for run in runs}
    frozen_steps, admitted = _admissions_while_leader_at_cap(by_policy["on"])
    assert frozen_steps > 0, "the scenario must reach the cap for this test to mean anything"
    assert admitted == 0
    # The same check catches a policy without the gate: upstream admits on those steps.
    assert _admissions_while_leader_at_cap(by_policy["off"])[1] > 0


def test_gate_freezes_exactly_the_steps_after_some_rank_ended_at_the_cap(tiny_runs):
    _, runs = tiny_runs
    by_policy = {run.summary.policy: run for run in runs}
    # held: some scheduling rank's own admission_frozen, decided from what the sim gathered.
    on = by_policy["on"]
    assert on.record.log.held == _leader_was_at_cap(on)
    # Negative control: the reverted cap-1 gate also freezes one request below the cap.
    cap_minus_one = by_policy["cap-1"]
    assert cap_minus_one.record.log.held != _leader_was_at_cap(cap_minus_one)


def test_same_arrivals_for_every_policy(tiny_workload):
    again = build_workload(TINY)
    assert again.arrivals == tiny_workload.arrivals
    other = build_workload(dataclasses.replace(TINY, seed=8))
    assert other.arrivals != tiny_workload.arrivals


def test_run_policy_rejects_unknown_policy(tiny_workload):
    with pytest.raises(ValueError, match="policy 'sometimes'"):
        run_policy(TINY, "sometimes", tiny_workload)


@pytest.mark.parametrize("policy", ["on", "bounded-hold:3"])
def test_product_counters_match_the_simulators_accounting(tiny_runs, policy):
    """The schedulers' own BalanceStats agree with what the simulator logged on the same run."""
    _, runs = tiny_runs
    [run] = [r for r in runs if r.record.policy == policy]
    log, stats = run.record.log, run.record.balance_stats
    assert len(stats) == TINY.dp_size
    # The product's own reduction of the gathered vectors, against the logged running counts.
    largest_gap = max(max(row) - min(row) for row in log.running)
    assert all(s.largest_gap == largest_gap for s in stats)
    assert all(
        (s.gathered_max, s.gathered_min) == (max(log.running[-1]), min(log.running[-1]))
        for s in stats
    )
    # The simulator's "held" step is one where some scheduling rank was frozen.
    held_steps = sum(log.held)
    assert max(s.frozen_steps for s in stats) <= held_steps <= sum(s.frozen_steps for s in stats)


# --- what advise reads from a run: does the queue grow? ---------------------------------------


def _record_with(arrivals_s, first_tokens_s):
    from balance_sim.engine import RequestRecord, RunRecord, StepLog

    requests = {
        f"r{i}": RequestRecord(0, arrival, 1, first, first, 1, True)
        for i, (arrival, first) in enumerate(zip(arrivals_s, first_tokens_s))
    }
    return RunRecord("off", None, max(first_tokens_s), requests, StepLog(), [])


def test_queue_growth_is_the_part_of_the_second_halfs_arrivals_left_queued():
    from balance_sim.metrics import queue_growth

    arrivals = [float(i) for i in range(100)]
    # Served 0.5 s after arriving: the backlog never grows.
    assert queue_growth(_record_with(arrivals, [t + 0.5 for t in arrivals])) == 0.0
    # Served at half the arrival rate: half of each half's arrivals stay queued.
    assert queue_growth(_record_with(arrivals, [2.0 * t + 0.5 for t in arrivals])) == 0.5


def test_an_overloaded_run_grows_its_queue_and_fills_a_rank(tiny_runs):
    """TINY arrives at 400 req/s, far beyond what 4 ranks x 4 seats serve."""
    from balance_sim.advise import QUEUE_GROWTH
    from balance_sim.metrics import fullest_rank, queue_growth

    _, runs = tiny_runs
    off = next(run for run in runs if run.summary.policy == "off")
    assert queue_growth(off.record) > QUEUE_GROWTH
    assert fullest_rank(off.record) == TINY.max_num_seqs


# --- step-time model: shared expert work and the gather's own cost ----------------------------


def test_shared_fraction_moves_a_bursts_share_from_its_rank_to_all_ranks():
    burst = [RankWork(prefill_tokens=1000), RankWork(), RankWork(), RankWork()]
    per_rank, shared, half = (
        StepTimeModel(shared_fraction=f).step_time_ms(burst) for f in (0.0, 1.0, 0.5)
    )
    assert per_rank == pytest.approx(20.0 + 0.11 * 1000)  # the bursting rank stalls everyone
    assert shared == pytest.approx(20.0 + 0.11 * 1000 / 4)  # its expert work is spread over 4
    assert half == pytest.approx(20.0 + 0.11 * 500 + 0.11 * 500 / 4)
    # Evenly spread work costs the same whatever the fraction: sharing only moves imbalance.
    even = [RankWork(prefill_tokens=250, decode_requests=8, kv_tokens=100)] * 4
    assert (
        len({round(StepTimeModel(shared_fraction=f).step_time_ms(even), 9) for f in (0, 0.5, 1)})
        == 1
    )


def _simultaneous_run(policy: str, gather_ms: float, gather_hop_us: float = 0.0, dp: int = 2):
    """A DP cluster where every request arrives at t=0: decisions cannot depend on time."""
    from balance_sim.engine import Cluster
    from balance_sim.policies import make_policy
    from balance_sim.router import make_router
    from balance_sim.runner import cluster_config

    options = dataclasses.replace(TINY, dp_size=dp, max_num_seqs=2)
    arrivals = [Arrival(i, 0.0, 40, 5) for i in range(4 * dp)]
    cluster = Cluster(
        cluster_config(options, arrivals),
        make_policy(policy),
        make_router("least-loaded", dp, "stale+bump", 0.1),
        StepTimeModel(gather_ms=gather_ms, gather_hop_us=gather_hop_us),
        arrivals,
    )
    return cluster.run().log


@pytest.mark.parametrize("policy, charged", [("on", True), ("off", False)])
def test_the_gather_costs_gather_ms_per_step_only_where_balance_gathers(policy, charged):
    free, paid = _simultaneous_run(policy, 0.0), _simultaneous_run(policy, 5.0)
    assert paid.running == free.running and len(free.time_s) > 5
    extra = [p - f for p, f in zip(paid.time_s, free.time_s)]
    expected = [0.005 * (step + 1) if charged else 0.0 for step in range(len(extra))]
    assert extra == pytest.approx(expected)


def test_gather_cost_is_the_fixed_part_plus_one_hop_per_ring_step():
    """Gloo's all_gather is a ring of DP-1 sequential hops (docs/scaling.md)."""
    model = StepTimeModel(gather_ms=0.5, gather_hop_us=50)
    assert [model.gather_cost_ms(dp) for dp in (2, 8, 256)] == pytest.approx([0.55, 0.85, 13.25])
    assert StepTimeModel(gather_ms=0.5).gather_cost_ms(256) == 0.5  # unset: the constant


def test_recursive_doubling_gather_costs_its_log_depth_hops():
    """balance_collective=recursive_doubling: log2 of the power-of-two core, +2 to fold extras in
    (not ceil(log2 DP): DP=3 is 3 hops, one more than the ring's 2)."""
    from balance_sim.stepmodel import recursive_doubling_hops

    dps = (2, 3, 4, 5, 6, 8, 9, 32, 64, 100, 128, 256)
    assert [recursive_doubling_hops(dp) for dp in dps] == [1, 3, 2, 4, 4, 3, 5, 5, 6, 8, 7, 8]
    model = StepTimeModel(gather_ms=0.5, gather_hop_us=50, gather_collective="recursive_doubling")
    assert [model.gather_cost_ms(dp) for dp in (2, 8, 256)] == pytest.approx([0.55, 0.65, 0.9])


def test_step_model_file_names_the_gather_collective(tmp_path):
    from balance_sim.stepmodel import StepModelError, load_step_model

    path = tmp_path / "model.json"
    path.write_text('{"gather_hop_us": 50, "gather_collective": "recursive_doubling"}')
    assert load_step_model(path).gather_cost_ms(64) == pytest.approx(0.64 + 6 * 0.05)
    path.write_text('{"gather_collective": "ring"}')
    with pytest.raises(StepModelError, match="must be one of all_gather, recursive_doubling"):
        load_step_model(path)


@pytest.mark.parametrize("policy, charged", [("on", True), ("off", False)])
def test_the_gather_costs_dp_minus_1_hops_per_step_only_where_balance_gathers(policy, charged):
    free = _simultaneous_run(policy, 1.0, dp=4)
    paid = _simultaneous_run(policy, 1.0, gather_hop_us=2000.0, dp=4)  # 3 hops: +6 ms a step
    assert paid.running == free.running and len(free.time_s) > 5
    extra = [p - f for p, f in zip(paid.time_s, free.time_s)]
    expected = [0.006 * (step + 1) if charged else 0.0 for step in range(len(extra))]
    assert extra == pytest.approx(expected)


def test_sim_json_names_gather_hop_us_only_when_it_is_set(tiny_workload):
    from balance_sim.runner import scenario_json

    unset = scenario_json(TINY, tiny_workload, import_vllm=False)["step_model"]
    hop = dataclasses.replace(TINY, step_model=StepTimeModel(gather_hop_us=30.0))
    assert "gather_hop_us" not in unset  # every earlier sim.json stays byte-identical
    assert "gather_collective" not in unset
    assert scenario_json(hop, tiny_workload, import_vllm=False)["step_model"]["gather_hop_us"] == 30


# A small DP MoE cluster with the default scenario's prompt lengths, at 1.4x the load its
# running caps hold: ranks reach the cap and the gate acts (~50% of steps frozen).
LOADED = SimOptions(
    dp_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=2048,
    num_requests=160,
    concurrency=round(1.4 * 4 * 8),
    prompt_len="uniform:128:1024",
    output_len="uniform:8:40",
    seed=0,
)


def _off_and_on(shared_fraction: float) -> dict:
    options = dataclasses.replace(LOADED, step_model=StepTimeModel(shared_fraction=shared_fraction))
    workload = build_workload(options)
    return {p: run_policy(options, p, workload).summary for p in ("off", "on")}


def test_with_expert_work_fully_shared_the_gate_delays_first_tokens_at_high_load():
    """Where a rank's prefill stalls only a 1/DP share of the others, holding
    admission buys nothing back and the held requests wait: ``on`` worsens TTFT."""
    shared = _off_and_on(1.0)
    assert shared["on"].ttft_p50_ms > shared["off"].ttft_p50_ms
    assert shared["on"].ttft_p99_ms > shared["off"].ttft_p99_ms
    # The same load with every rank's work its own: the gate shortens the TTFT tail. Without
    # this the test could not tell the sharing from a gate that always delays.
    own = _off_and_on(0.0)
    assert own["on"].ttft_p99_ms < own["off"].ttft_p99_ms


def test_inflight_floor_router_is_vllm_0_27s_balancer():
    """vLLM >= 0.27 scores max(in-flight, snapshot waiting + running), a waiting request weighing
    as one running (0.26 and before: waiting * 4 + running), and rotates the scan's start."""
    from balance_sim.router import make_router

    new = make_router("inflight-floor", 2, "stale+bump", 0.1)
    old = make_router("least-loaded", 2, "fresh", 0.1)
    live = [(1, 0), (0, 2)]  # (waiting, running)
    assert new.route(lambda: live) == 0  # 1 in flight vs 2
    assert old.route(lambda: live) == 1  # 1 * 4 + 0 vs 2


def test_inflight_floor_router_counts_the_live_floor_the_bump_and_rotates_ties():
    from balance_sim.router import make_router

    router = make_router("inflight-floor", 4, "stale+bump", 0.1)  # the snapshot: all idle
    live = [(0, 3), (0, 0), (0, 1), (0, 0)]
    assert router.route(lambda: live) == 1  # rank 0's 3 in flight beat the stale snapshot
    # The scan now starts at rank 1, whose snapshot carries the bump (1): rank 3 (0) wins.
    assert router.route(lambda: live) == 3
    router.publish(1.0, [(0, 0)] * 4)  # a fresh snapshot drops the bumps
    assert router.route(lambda: [(0, 0)] * 4) == 2  # equal scores: the rotated start wins


def printed_table(text: str) -> list[str]:
    """The per-policy table of the main job's output: its header line to the first blank one."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("policy "))
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    return lines[start:end]


def test_readme_table_is_what_the_main_job_prints(tmp_path):
    """README's "What the main job prints", row for row: the default scenario on the release-tag
    vLLM without the seam, as ``nox -s sim`` runs it (simulated numbers are deterministic); and
    README's list of expected harmless log lines, each printed by that run."""
    import subprocess
    import sys

    from conftest import ROOT, session_has_seam, session_pin_name

    if session_pin_name() != "release-tag" or session_has_seam():
        pytest.skip("README's table is the release-tag vLLM's without the seam (nox -s sim)")
    run = subprocess.run(
        [sys.executable, "-m", "balance_sim", "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    expected = printed_table(readme.split("### What the main job prints", 1)[1])
    assert printed_table(run.stdout) == expected
    # README's list of the harmless log lines: each one is printed, as quoted.
    listed = " ".join(readme.split("Expected on CPU and harmless", 1)[1].split("\n\n")[0].split())
    printed = " ".join((run.stdout + run.stderr).split())
    quoted = re.findall(r"`([^`]+)`", listed)
    assert len(quoted) == 4 and [q for q in quoted if q not in printed] == []
