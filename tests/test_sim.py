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
import json

import pytest

from vllm_balance.sim.runner import SimOptions, build_workload, run_policy
from vllm_balance.sim.workload import TraceError, load_trace

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
)


@pytest.fixture(scope="module")
def tiny_workload():
    return build_workload(TINY)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    from vllm_balance.sim.__main__ import simulate

    out = tmp_path_factory.mktemp("sim")
    runs = simulate(TINY, out, plots=True, progress=False)
    return out, runs


def test_same_seed_gives_byte_identical_json(tiny_runs, tmp_path):
    from vllm_balance.sim.__main__ import simulate

    first_dir, _ = tiny_runs
    simulate(TINY, tmp_path, plots=False, progress=False)
    assert (tmp_path / "sim.json").read_bytes() == (first_dir / "sim.json").read_bytes()


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

    from vllm_balance.sim.report import running_figure

    out, runs = tiny_runs
    for name in ("running_per_rank.png", "ttft_cdf.png", "tpot_cdf.png"):
        with Image.open(out / name) as image:
            image.verify()
            assert image.size[0] > 300 and image.size[1] > 200
    figure = running_figure([(run.cluster, run.summary) for run in runs])
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
    from vllm_balance.sim.__main__ import main

    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"arrival_time": 0, "prompt_len": 0, "output_len": 1}\n')
    assert main(["--trace", str(trace), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    assert f"{trace}:1: field 'prompt_len' must be an integer >= 1" in capsys.readouterr().err


def _leader_was_at_cap(run) -> list[bool]:
    """Per step: some rank ended the previous step at the cap (a wave starts with none running)."""
    previous_running = [[0] * TINY.dp_size] + run.cluster.log.running[:-1]
    return [max(row) == TINY.max_num_seqs for row in previous_running]


def _admissions_while_leader_at_cap(run) -> tuple[int, int]:
    """(steps whose gate input had a rank at the cap, admissions made on those steps)."""
    at_cap = [i for i, flag in enumerate(_leader_was_at_cap(run)) if flag]
    return len(at_cap), sum(sum(run.cluster.log.admitted[i]) for i in at_cap)


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
    assert on.cluster.log.held == _leader_was_at_cap(on)
    # Negative control: the reverted cap-1 gate also freezes one request below the cap.
    cap_minus_one = by_policy["cap-1"]
    assert cap_minus_one.cluster.log.held != _leader_was_at_cap(cap_minus_one)


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
    [run] = [r for r in runs if r.cluster.policy.name == policy]
    log, schedulers = run.cluster.log, run.cluster.schedulers
    stats = [s.balance_stats for s in schedulers]
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
