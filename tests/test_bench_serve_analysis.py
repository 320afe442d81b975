"""``nox -s bench-serve``'s calibration: engine-core step records in, the simulator's model out.

The records are what ``vllm_balance_e2e_plugins.step_timing`` writes (one JSON object per rank
and busy-loop step); their periods come from the simulator's own ``StepTimeModel`` with known
coefficients, so the fit must give those coefficients back. The negative control is the mistake
the pairing exists to avoid: fitting each rank's own work instead of the slowest rank's.
"""

from __future__ import annotations

import random

import pytest

from balance_sim.stepmodel import RankWork, StepTimeModel
from benchmarks.serve_report import IDLE_GAP_MS, cluster_steps, fit_step_model

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
    assert model["fixed_ms"] == pytest.approx(TRUE.fixed_ms, rel=0.02)
    assert model["per_prefill_token_ms"] == pytest.approx(TRUE.per_prefill_token_ms, rel=0.02)
    assert model["per_decode_request_ms"] == pytest.approx(TRUE.per_decode_request_ms, rel=0.05)


def test_the_fit_is_not_pulled_by_stalled_steps():
    """A few steps stretched by seconds (another job, a one-off stall) leave the fit as it was."""
    steps = cluster_steps(step_records(ranks=4))
    for step in steps[::40]:
        step["period_ms"] += 3000.0
    model = fit_step_model(steps)
    assert model["fixed_ms"] == pytest.approx(TRUE.fixed_ms, rel=0.02)
    assert model["per_prefill_token_ms"] == pytest.approx(TRUE.per_prefill_token_ms, rel=0.02)
    assert model["fit"]["outliers"] >= len(steps[::40])


def test_negative_control_one_ranks_own_work_does_not_fit():
    """Pairing rank 0's work alone with the cluster's period (no max over ranks) misfits."""
    steps = cluster_steps(step_records())
    for step in steps:
        step["work"] = [step["work"][0], (0, 0, 0)]
    model = fit_step_model(steps)
    assert model["per_prefill_token_ms"] != pytest.approx(TRUE.per_prefill_token_ms, rel=0.02)
