"""``nox -s bench-emulated``'s arithmetic: the emulated device time of a batch; which runs count.

The device-time plugin (``vllm_balance_e2e_plugins.device_time``) sleeps, per rank and forward,
the time the simulator's step model gives for that rank's batch. Here it reads real
``SchedulerOutput``s of a real scheduler, and must charge exactly what the simulator charges
the same rank for the same step (``engine._rank_work`` + ``StepTimeModel.rank_time_ms``). The
headroom rule decides which runs the benchmark keeps: a run whose ranks' CPU time is not well
under their emulated device time measures the machine, and is left out of the means.
"""

from __future__ import annotations

import pytest
from vllm_balance_e2e_plugins import device_time

from balance_sim.stepmodel import StepModelError, StepTimeModel
from benchmarks.emulated_analyse import valid_runs
from benchmarks.emulated_measure import CPU_SHARE_LIMIT, headroom

MODEL = StepTimeModel(
    fixed_ms=100.0, per_prefill_token_ms=0.55, per_decode_request_ms=1.55, per_kv_token_ms=0.01
)


def stepped_outputs():
    """A real scheduler's outputs over a run with staggered arrivals: new prefills, chunked
    prefills (the token budget is smaller than a prompt), decodes beside them, finishes."""
    from balance_sim.engine import _rank_work
    from balance_testbed.factories import (
        add_requests,
        make_requests,
        make_scheduler,
        model_runner_output,
    )

    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    outputs = []
    for wave in range(3):
        add_requests(
            scheduler, make_requests(3, prompt_len=40 + 30 * wave, max_tokens=6, start=10 * wave)
        )
        for _ in range(6):
            output = scheduler.schedule()
            # The simulator reads the rank's work right after schedule(), as here.
            outputs.append((scheduler, output, _rank_work(scheduler, output)))
            scheduler.update_from_output(output, model_runner_output(output, scheduler))
    return outputs


def test_emulated_batch_time_is_what_the_simulator_charges_the_rank():
    kinds = set()
    for _, output, work in stepped_outputs():
        if not output.total_num_scheduled_tokens:
            continue
        kinds.add((work.prefill_tokens > 0, work.decode_requests > 0))
        expected = MODEL.rank_time_ms(work.prefill_tokens, work.decode_requests, work.kv_tokens)
        assert device_time.batch_ms(MODEL, output) == pytest.approx(expected)
    # Prefill only, decode only, and both in one batch were all exercised.
    assert {(True, False), (False, True), (True, True)} <= kinds


def test_an_empty_step_is_no_forward_and_sleeps_nothing():
    """vLLM's model runner returns without a forward when nothing is scheduled; the dummy batch
    that follows is the forward (``fixed_ms``)."""
    from balance_testbed.factories import make_scheduler

    output = make_scheduler().schedule()
    assert output.total_num_scheduled_tokens == 0
    assert device_time.batch_ms(MODEL, output) == 0.0


def test_the_emulation_refuses_a_shared_fraction(tmp_path):
    path = tmp_path / "device.json"
    path.write_text('{"fixed_ms": 100, "shared_fraction": 0.5}')
    with pytest.raises(StepModelError, match="needs 0"):
        device_time.load_device_model(path)
    path.write_text('{"fixed_ms": 100}')
    assert device_time.load_device_model(path).fixed_ms == 100.0


def rank_records(cpu_ms_per_step: list[float], device_ms_per_step: float = 100.0, steps=50):
    """Each rank's step records (the cumulative clocks ``step_timing`` writes)."""
    by_rank = {}
    for rank, cpu_ms in enumerate(cpu_ms_per_step):
        by_rank[rank] = [
            {
                "rank": rank,
                "t": i * 0.1,
                "cpu_s": i * cpu_ms / 1e3,
                "device_ms": i * device_ms_per_step,
            }
            for i in range(steps)
        ]
    return by_rank


def test_a_run_is_valid_when_every_rank_cpu_is_well_under_its_device_time():
    result = headroom(rank_records([10.0, 20.0, 15.0, 5.0]))
    assert result["valid"] and result["cpu_share_worst"] == pytest.approx(0.2)


def test_negative_control_one_busy_rank_makes_the_run_invalid():
    busy = 100.0 * CPU_SHARE_LIMIT * 1.5
    result = headroom(rank_records([10.0, busy, 15.0, 5.0]))
    assert not result["valid"] and result["cpu_share_worst"] == pytest.approx(busy / 100.0)


def test_a_run_without_emulated_device_time_is_invalid():
    assert not headroom(rank_records([10.0, 10.0], device_ms_per_step=0.0))["valid"]


def test_invalid_runs_are_left_out_of_the_means():
    runs = [
        {"policy": "on", "headroom": headroom(rank_records([10.0, 10.0]))},
        {"policy": "on", "headroom": headroom(rank_records([10.0, 80.0]))},
    ]
    assert valid_runs(runs) == runs[:1]


def test_the_measured_ratio_interval_pairs_the_same_requests():
    """Every run serves the same requests in the same order: resampled in pairs, a policy that
    changes nothing has the interval [1, 1] and one that doubles every TTFT [2, 2], however
    spread the requests are; unpaired (different counts), the same values spread around 1."""
    import numpy as np

    from benchmarks.emulated_analyse import bootstrap_ratio

    base = np.random.default_rng(1).lognormal(7.0, 1.0, 200)
    assert bootstrap_ratio(base, base, 99) == [1.0, 1.0]
    assert bootstrap_ratio(base, 2.0 * base, 99) == [2.0, 2.0]
    low, high = bootstrap_ratio(base, base[:199], 99)
    assert low < 1.0 < high


def test_the_report_renders_the_committed_groups_to_the_results_table():
    """docs/results.md's table under "Emulated device, DP=4/8" is what the report renders from
    the groups committed beside it (docs/bench-emulated.json, through the typed results)."""
    import json
    from pathlib import Path

    from benchmarks.emulated_analyse import GroupResult
    from benchmarks.emulated_render import results_table

    docs = Path(__file__).resolve().parents[1] / "docs"
    summary = json.loads((docs / "bench-emulated.json").read_text())
    results = {name: GroupResult.from_json(group) for name, group in summary["groups"].items()}
    # The same layout back: summary.json's groups pass through the typed results unchanged.
    assert {name: result.to_json() for name, result in results.items()} == summary["groups"]
    lines = results_table(summary["runs"], results)
    section = (docs / "results.md").read_text().split("## Emulated device, DP=4/8")[1]
    start = section.index(lines[0])
    assert section[start:].splitlines()[: len(lines)] == lines


def test_the_findings_line_quotes_the_table_ranges_from_the_knee_up():
    """The per-rank finding's throughput, TTFT p99 and TPOT p50 ranges are the table's measured
    values at loads from 1.0x (the knee) up: a summary that drifted from its table (1.16-1.43x
    against 1.01-1.43x once) fails here."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "results.md").read_text()
    section = text.split("## Emulated device, DP=4/8")[1]
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ") and ", per-rank |" in line
    ]
    from_knee = [row for row in rows if float(row[1].rstrip("x")) >= 1.0]
    assert from_knee

    def measured(column: int) -> list[float]:
        return [float(row[column].split()[0]) for row in from_knee]

    finding = next(line for line in section.splitlines() if line.startswith("| per-rank device"))
    for name, column in (("throughput", 3), ("TTFT p99", 5), ("TPOT p50", 6)):
        values = measured(column)
        quoted = f"{name} {min(values):.2f}-{max(values):.2f}x"
        assert quoted in finding, (quoted, re.findall(rf"{name} [\d.]+-[\d.]+x", finding))
