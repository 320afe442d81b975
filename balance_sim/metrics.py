"""The numbers of one policy run, from the cluster's own records (simulated time only)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from balance_sim.engine import RunRecord

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


def queue_growth(run: RunRecord) -> float:
    """The part of the second half's arrivals that stayed queued: the backlog (requests arrived
    and without a first token) at the last arrival minus the backlog at the middle arrival,
    over the arrivals in between.

    About 0 where the cluster keeps up with its arrivals: the backlog only fluctuates (within
    +-0.02 in the default scenario at 0.6x and 1.0x, seed 0, off and on). About
    ``1 - 1/load`` where it cannot: the queue then grows for as long as requests arrive, and
    every TTFT number grows with the run's length (off at 1.2x: 0.17-0.25; its TTFT p99 9.7 /
    20.5 / 44.4 s at 1000 / 2000 / 4000 requests).
    """
    arrivals = sorted(r.arrival_s for r in run.requests.values())
    first_tokens = sorted(
        r.first_token_s for r in run.requests.values() if r.first_token_s is not None
    )
    if len(arrivals) < 2:
        return 0.0

    def backlog(at_s: float) -> int:
        return bisect.bisect_right(arrivals, at_s) - bisect.bisect_right(first_tokens, at_s)

    middle = len(arrivals) // 2
    grown = backlog(arrivals[-1]) - backlog(arrivals[middle - 1])
    return grown / (len(arrivals) - middle)


def fullest_rank(run: RunRecord) -> int:
    """The most requests any rank was running after any step."""
    return max((max(row) for row in run.log.running if row), default=0)


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
