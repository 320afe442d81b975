"""``nox -s bench-serve``'s calibration: engine-core step records in, the simulator's model out.

The records are what ``vllm_balance_e2e_plugins.step_timing`` writes (one JSON object per rank
and busy-loop step); their periods come from the simulator's own ``StepTimeModel`` with known
coefficients, so the fit must give those coefficients back. The negative control is the mistake
the pairing exists to avoid: fitting each rank's own work instead of the slowest rank's. The
report's typed results read the committed summary (docs/bench-serve.json) and write it back as
it is, and render the tables docs/results.md shows from it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from balance_sim.stepmodel import RankWork, StepTimeModel
from benchmarks.serve_report import (
    IDLE_GAP_MS,
    Summary,
    agreement,
    agreement_markdown,
    cluster_steps,
    fit_step_model,
    table_markdown,
)

pytestmark = pytest.mark.path_independent

DOCS = Path(__file__).resolve().parents[1] / "docs"

TRUE = StepTimeModel(fixed_ms=20.0, per_prefill_token_ms=0.3, per_decode_request_ms=2.0)
OVERHEAD_MS = 1.5  # outside _process_engine_step(): the all-reduce, the gather, bookkeeping


def step_records(steps: int = 400, seed: int = 0, ranks: int = 2) -> list[dict]:
    """Lock-stepped ranks: each step all start together and last the cluster's step time."""
    rng = random.Random(seed)
    records, t = [], 100.0
    for index in range(steps):
        works = []
        for _ in range(ranks):
            prefill = rng.choice([0, 0, 0, rng.randint(64, 384)])
            works.append(RankWork(prefill_tokens=prefill, decode_requests=rng.randint(0, 4)))
        period_ms = TRUE.step_time_ms(works)
        for rank, work in enumerate(works):
            executed = bool(work.prefill_tokens or work.decode_requests)
            records.append(
                {
                    "rank": rank,
                    "t": t + rank * 1e-4,
                    "ms": period_ms - OVERHEAD_MS,
                    "executed": executed,
                    "prefill_tokens": work.prefill_tokens,
                    "prefill_reqs": int(work.prefill_tokens > 0),
                    "decode_reqs": work.decode_requests,
                    "kv_tokens": 0,
                }
            )
        t += period_ms / 1000.0
        if index == steps // 2:
            t += 2.0  # the server went idle: this iteration is not a step time
    return records


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_fit_gives_back_the_step_model_that_made_the_periods(ranks):
    steps = cluster_steps(step_records(ranks=ranks))
    assert steps, "no step paired"
    assert all(len(step["work"]) == ranks for step in steps)
    assert all(step["gap_ms"] <= IDLE_GAP_MS for step in steps)  # the idle gap is dropped
    model = fit_step_model(steps)
    assert model.fixed_ms == pytest.approx(TRUE.fixed_ms, rel=0.02)
    assert model.per_prefill_token_ms == pytest.approx(TRUE.per_prefill_token_ms, rel=0.02)
    assert model.per_decode_request_ms == pytest.approx(TRUE.per_decode_request_ms, rel=0.05)


def test_the_fit_is_not_pulled_by_stalled_steps():
    """A few steps stretched by seconds (another job, a one-off stall) leave the fit as it was."""
    steps = cluster_steps(step_records(ranks=4))
    for step in steps[::40]:
        step["period_ms"] += 3000.0
    model = fit_step_model(steps)
    assert model.fixed_ms == pytest.approx(TRUE.fixed_ms, rel=0.02)
    assert model.per_prefill_token_ms == pytest.approx(TRUE.per_prefill_token_ms, rel=0.02)
    assert model.fit.outliers >= len(steps[::40])


def test_negative_control_one_ranks_own_work_does_not_fit():
    """Pairing rank 0's work alone with the cluster's period (no max over ranks) misfits."""
    steps = cluster_steps(step_records())
    for step in steps:
        step["work"] = [step["work"][0], (0, 0, 0)]
    model = fit_step_model(steps)
    assert model.per_prefill_token_ms != pytest.approx(TRUE.per_prefill_token_ms, rel=0.02)


def test_the_committed_summary_reads_and_writes_back_byte_for_byte():
    """summary.json through the typed results and back is the same file (as ``report`` writes
    it): key order, the parts an older run lacks (the simulated ``balance``) and all."""
    text = (DOCS / "bench-serve.json").read_text()
    summary = Summary.from_json(json.loads(text))
    assert summary.step_model and summary.step_model.gather_ms == 5.207
    assert json.dumps(summary.to_json(), indent=1) + "\n" == text


def cells(markdown: str) -> list[list[str]]:
    """A Markdown table's rows (its header first), each a list of its cells."""
    return [line.strip("| ").split(" | ") for line in markdown.splitlines() if line[:2] == "| "]


def test_the_committed_summary_renders_the_tables_docs_results_shows():
    """docs/results.md's bench-serve table is the report's table of the committed summary, off /
    on side by side; the agreement computed again from the committed tables is the committed
    one, and its signs disagree only at 3 req/s (throughput), as docs/results.md says."""
    summary = Summary.from_json(json.loads((DOCS / "bench-serve.json").read_text()))
    rows = {
        (row[0], row[1]): row for row in cells(table_markdown(summary.measured, summary.simulated))
    }
    section = (DOCS / "results.md").read_text().split("## A real server")[1].split("\n## ")[0]
    shown = [row for row in cells(section) if row[0] in ("1", "3", "6", "10")]
    assert [row[0] for row in shown] == ["1", "3", "6", "10"]
    for row in shown:
        off, on = rows["off", row[0]], rows["on", row[0]]
        # tok/s, TTFT p50, TTFT p99, TPOT p50, sim tok/s, sim TTFT p99
        assert row[1:] == [f"{off[i]} / {on[i]}" for i in (2, 3, 4, 5, 6, 8)]
    again = agreement(summary.measured, summary.simulated)
    assert again == summary.agreement
    signs = cells(agreement_markdown(again).split("\n\n")[0])[1:]
    assert [(row[0], row[2], row[4]) for row in signs] == [
        ("1", "yes", "yes"),
        ("3", "yes", "**no**"),
        ("6", "yes", "yes"),
        ("10", "yes", "yes"),
    ]
