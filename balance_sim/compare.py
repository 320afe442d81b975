"""Policy vs ``off`` over several seeds: the change in each metric, its spread, and a verdict.

One judgement serves both ``advise`` and the operating envelope, so the words "helps",
"neutral" and "hurts" mean the same thing in docs/results.md and on an operator's terminal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A change smaller than this (percent of off's value) is "no difference": the gather's own cost
# alone moves TPOT by 1-3% at the default step model, and seed-to-seed spread is of that order.
NEUTRAL_PCT = 5.0

# (Summary field, name shown, +1 if higher is better else -1, judged)
# TPOT is shown but not judged: a policy that holds admissions runs smaller batches, so its TPOT
# falls whenever it holds, whatever it costs in TTFT and throughput; those two are the verdict.
METRICS = (
    ("ttft_p99_ms", "TTFT p99", -1, True),
    ("ttft_p50_ms", "TTFT p50", -1, True),
    ("output_tok_per_s", "throughput", +1, True),
    ("tpot_p50_ms", "TPOT p50", -1, False),
)


@dataclass(frozen=True)
class Change:
    """One metric's change vs off, in percent of off's value, per seed."""

    metric: str
    name: str
    sign: int  # +1: higher is better
    judged: bool  # counts towards the verdict
    per_seed: tuple[float, ...]

    @property
    def mean(self) -> float:
        return sum(self.per_seed) / len(self.per_seed)

    @property
    def low(self) -> float:
        return min(self.per_seed)

    @property
    def high(self) -> float:
        return max(self.per_seed)

    def _benefits(self) -> list[float]:
        return [self.sign * c for c in self.per_seed]

    @property
    def improves(self) -> bool:
        """Better by more than NEUTRAL_PCT on average, and better on every seed."""
        gains = self._benefits()
        return sum(gains) / len(gains) > NEUTRAL_PCT and min(gains) > 0

    @property
    def worsens(self) -> bool:
        gains = self._benefits()
        return sum(gains) / len(gains) < -NEUTRAL_PCT and max(gains) < 0

    @property
    def seeds_disagree(self) -> bool:
        """Large on average, but seeds on both sides of zero: the run cannot tell."""
        return abs(self.mean) > NEUTRAL_PCT and not (self.improves or self.worsens)

    @property
    def straddles(self) -> bool:
        """Some seed better and some seed worse, each by more than NEUTRAL_PCT, whatever the
        mean: the seeds do not agree on the sign, so a small mean is no evidence of "no
        difference" (a calibrated DP=2 case: mean +1%, seeds -12..+27%)."""
        return self.low < -NEUTRAL_PCT and self.high > NEUTRAL_PCT

    def text(self) -> str:
        spread = f"seeds {self.low:+.1f}..{self.high:+.1f}%" if len(self.per_seed) > 1 else ""
        return f"{self.name} {self.mean:+.1f}%" + (f" ({spread})" if spread else "")


def _percent(new: float, old: float) -> float:
    return (new - old) / old * 100.0 if old else 0.0


def changes(baseline: Sequence, variant: Sequence) -> list[Change]:
    """Per-metric changes of ``variant`` vs ``baseline``: Summaries paired seed by seed."""
    return [
        Change(
            metric,
            name,
            sign,
            judged,
            tuple(
                _percent(getattr(v, metric), getattr(b, metric)) for b, v in zip(baseline, variant)
            ),
        )
        for metric, name, sign, judged in METRICS
    ]


HELPS, NEUTRAL, HURTS, MIXED, UNCLEAR = "helps", "neutral", "hurts", "mixed", "unclear"


def verdict(metric_changes: Sequence[Change], straddle_is_unclear: bool = False) -> str:
    """helps: some judged metric better, none worse; hurts: the reverse; mixed: both; neutral:
    none. unclear: none clearly moved, but some moved a lot on average with seeds disagreeing.

    ``straddle_is_unclear``: also unclear when none clearly moved but some judged metric's seeds
    lie beyond the threshold on both sides of zero (:attr:`Change.straddles`). ``advise`` asks
    for it: one operator's decision must not read "no difference" out of seeds that disagree.
    The operating envelope keeps the mean-only rule its tables in docs/results.md were made
    with (their spreads are not all in the document to relabel them).
    """
    judged = [c for c in metric_changes if c.judged]
    better = any(c.improves for c in judged)
    worse = any(c.worsens for c in judged)
    if better and worse:
        return MIXED
    if better:
        return HELPS
    if worse:
        return HURTS
    if any(c.seeds_disagree or (straddle_is_unclear and c.straddles) for c in judged):
        return UNCLEAR
    return NEUTRAL
