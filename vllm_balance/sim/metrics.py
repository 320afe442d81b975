"""The numbers of one policy run, from the cluster's own records (simulated time only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_balance.sim.engine import RunRecord

DIGITS = 6  # rounding for JSON: readable, and identical for identical runs


@dataclass(frozen=True)
class Summary:
    policy: str
    output_tok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    balance_ratio: float
    frozen_fraction: float
    completed: int
    submitted: int
    steps: int
    makespan_s: float


def _percentile_ms(values_s: list[float], q: float) -> float:
    return float(np.percentile(values_s, q) * 1000.0) if values_s else float("nan")


def ttfts_s(run: RunRecord) -> list[float]:
    return [
        r.first_token_s - r.arrival_s for r in run.requests.values() if r.first_token_s is not None
    ]


def tpots_s(run: RunRecord) -> list[float]:
    """Mean time per output token after the first, per request with at least two tokens."""
    return [
        (r.last_token_s - r.first_token_s) / (r.tokens - 1)
        for r in run.requests.values()
        if r.tokens > 1 and r.first_token_s is not None and r.last_token_s is not None
    ]


def balance_ratio(running: list[list[int]]) -> float:
    """Mean over steps of mean/max running across ranks (1.0 = even); empty steps skipped."""
    ratios = [sum(row) / len(row) / max(row) for row in running if max(row) > 0]
    return float(np.mean(ratios)) if ratios else 1.0


def summarize(run: RunRecord) -> Summary:
    records = list(run.requests.values())
    first_arrival = min((r.arrival_s for r in records), default=0.0)
    makespan = run.now_s - first_arrival
    tokens = sum(r.tokens for r in records)
    ttft, tpot = ttfts_s(run), tpots_s(run)
    log = run.log
    return Summary(
        policy=run.policy,
        output_tok_per_s=round(tokens / makespan, DIGITS) if makespan > 0 else 0.0,
        ttft_p50_ms=round(_percentile_ms(ttft, 50), DIGITS),
        ttft_p99_ms=round(_percentile_ms(ttft, 99), DIGITS),
        tpot_p50_ms=round(_percentile_ms(tpot, 50), DIGITS),
        tpot_p99_ms=round(_percentile_ms(tpot, 99), DIGITS),
        balance_ratio=round(balance_ratio(log.running), DIGITS),
        frozen_fraction=round(sum(log.held) / len(log.held), DIGITS) if log.held else 0.0,
        completed=sum(r.finished for r in records),
        submitted=len(records),
        steps=len(log.time_s),
        makespan_s=round(makespan, DIGITS),
    )
