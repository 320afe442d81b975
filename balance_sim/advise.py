"""``vllm-balance-sim advise``: should this deployment enable balance scheduling?

An operator gives what they can measure (DP, ``max_num_seqs``, request rate or concurrency,
length distributions or a trace, a step-model file with their per-rank and shared costs). The
simulator runs ``off``, ``on`` and the bounded hold over a few seeds on exactly that scenario,
judges ``on`` against ``off`` with :mod:`.compare` (the rule of docs/results.md's operating
envelope, plus: seeds beyond the threshold on both sides of zero are "unclear", never "no
difference"), and runs ``off`` and ``on`` again with each uncertain step-model term moved over
its documented range (:func:`sensitivity_variants`). The answer is one category, and the exit
status names it, so that a script can tell a verdict from a refusal:

====== ================== ======================================================================
status category           when
====== ================== ======================================================================
0      ENABLE             some judged metric better by more than 5% on every seed, none worse
3      DO NOT ENABLE      some judged metric worse by more than 5% on every seed, none better
4      NO DIFFERENCE      no judged metric moves by more than 5%, on average or on both sides
5      TRADE-OFF          some better and some worse, named
6      UNCLEAR            the seeds disagree: a large mean with seeds on both sides of zero, or
                          seeds beyond 5% on both sides
7      DEPENDS            the verdict changes within the range of an uncertain step-model term:
                          "depends on gather_ms" / "shared_fraction"; measure it first
8      NO RECOMMENDATION  the scenario is outside what the simulation can judge (decided before
                          simulating; or a run that did not finish)
2      error              a bad input: one line on stderr, ``vllm-balance-sim: error: ...``
====== ================== ======================================================================

Every answer states what it rests on (:func:`basis`): how often the gate froze (when never, the
difference is the gather's own cost alone, and it says so), whether ``off``'s or ``on``'s queue
grew over the run (then their TTFT numbers grow with the run's length, and are labelled so),
the verdict at each step-model variant, and the metrics the seeds did not settle. The bounded
hold's advice is labelled simulated only: both real measurements (docs/results.md: bench-serve,
a DP=2 CPU server; the emulated device at DP=4/8) measured it below plain ``on``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from balance_sim.compare import (
    HELPS,
    HURTS,
    MIXED,
    NEUTRAL,
    NEUTRAL_PCT,
    UNCLEAR,
    Change,
    changes,
    verdict,
)
from balance_sim.parallel import Job, cached_workload, run_jobs
from balance_sim.runner import SimOptions, offered_load, scenario_title
from balance_sim.stepmodel import StepTimeModel

MIN_REQUESTS = 200
MAX_LOAD = 1.6  # the top of docs/results.md's operating envelope

# The step model's uncertain terms and how far advise moves them (docs/sim.md, advise).
# gather: the given per-step cost divided and multiplied by this. On the one real server
# (docs/results.md, bench-serve) the gather's cost per step could be pinned only between 1.7 and
# 5.2 ms, a factor of 3, and the verdict at 6 req/s differed between the two.
GATHER_FACTOR = 3.0
# shared_fraction: the file's value +- this (clipped to 0..1), the operating envelope's grid
# step; a file without the key leaves the default 0, which is no measurement: 0..1 then.
SHARED_SPREAD = 0.25
# A queue that grew by more than this part of the second half's arrivals is growing, not
# fluctuating (metrics.queue_growth: steady runs stay within +-0.02, off at 1.2x grows 0.17-0.25).
QUEUE_GROWTH = 0.05

HOLD_CAVEAT = (
    "Simulated only: both real measurements (docs/results.md: bench-serve, a DP=2 CPU server at "
    "4 rates; the emulated device at DP=4/8 from the knee up) measured bounded-hold:8 below "
    "plain on."
)
MEASURE = {
    "gather_ms": "the gather's time per step with balance on, on /metrics: "
    "rate(vllm:balance_gather_seconds_total[5m]) / rate(vllm:balance_gathers_total[5m]) "
    "(docs/operations.md, Metrics)",
    "shared_fraction": "one step's time with the same prefill tokens spread evenly over the ranks "
    "vs all on one rank (docs/sim.md, Step-time model)",
}


@dataclass(frozen=True)
class Category:
    word: str
    status: int


ENABLE = Category("ENABLE", 0)
DO_NOT_ENABLE = Category("DO NOT ENABLE", 3)
NO_DIFFERENCE = Category("NO DIFFERENCE", 4)
TRADE_OFF = Category("TRADE-OFF", 5)
SEEDS_DISAGREE = Category("UNCLEAR", 6)
DEPENDS = Category("DEPENDS", 7)
NO_RECOMMENDATION = Category("NO RECOMMENDATION", 8)
CATEGORIES = (
    ENABLE,
    DO_NOT_ENABLE,
    NO_DIFFERENCE,
    TRADE_OFF,
    SEEDS_DISAGREE,
    DEPENDS,
    NO_RECOMMENDATION,
)
OF_VERDICT = {
    HELPS: ENABLE,
    HURTS: DO_NOT_ENABLE,
    NEUTRAL: NO_DIFFERENCE,
    MIXED: TRADE_OFF,
    UNCLEAR: SEEDS_DISAGREE,
}


def judge(metric_changes: Sequence[Change]) -> str:
    """advise's verdict: compare's, with seeds that straddle zero unclear."""
    return verdict(metric_changes, straddle_is_unclear=True)


# ------------------------------------------------------------------ before simulating
def load_text(load: float) -> str:
    if load == float("inf"):
        return "more than the step model serves at any concurrency"
    return f"{load:.2f}x dp x max_num_seqs in flight"


def refusals(options: SimOptions, load: float, submitted: int) -> list[str]:
    """Why the simulation cannot support a recommendation here (empty: it can). Decided from
    the options and the generated or loaded workload alone, before any run."""
    reasons = []
    if options.dp_size < 2:
        reasons.append("DP is 1: balance acts across data-parallel ranks and needs at least 2")
    if submitted < MIN_REQUESTS:
        reasons.append(
            f"{submitted} requests per run: a TTFT p99 needs at least {MIN_REQUESTS} "
            "(--num-requests, or a longer trace)"
        )
    if load > MAX_LOAD:
        reasons.append(
            f"the offered load is {load_text(load)} (the checked envelope ends at {MAX_LOAD}x): "
            "every policy's queue grows for as long as the overload lasts, so the difference "
            "measures the run length, not the policy"
        )
    return reasons


@dataclass(frozen=True)
class Variant:
    """The step model with one uncertain term moved."""

    term: str  # the step-model key: "gather_ms" or "shared_fraction"
    label: str  # how the output names it
    model: StepTimeModel

    @property
    def moves_off(self) -> bool:
        """off never gathers: a gather variant reuses the given model's off runs."""
        return self.term != "gather_ms"


def sensitivity_variants(
    model: StepTimeModel, dp_size: int, given_keys: Collection[str]
) -> list[Variant]:
    """The step models advise also judges ``on`` with: the gather's per-step cost (``gather_ms``,
    and ``gather_hop_us`` when set) / and x :data:`GATHER_FACTOR`; ``shared_fraction`` +-
    :data:`SHARED_SPREAD` where the file sets it, else 1 (the default 0 is no measurement)."""
    variants = []
    if model.gather_cost_ms(dp_size) > 0:
        for factor, how in ((1 / GATHER_FACTOR, "/"), (GATHER_FACTOR, "x")):
            moved = dataclasses.replace(
                model,
                gather_ms=model.gather_ms * factor,
                gather_hop_us=model.gather_hop_us * factor,
            )
            label = f"gather {moved.gather_cost_ms(dp_size):.3g} ms/step (given {how} 3)"
            variants.append(Variant("gather_ms", label, moved))
    given = model.shared_fraction
    if "shared_fraction" in given_keys:
        values = {max(0.0, given - SHARED_SPREAD), min(1.0, given + SHARED_SPREAD)}
        why = f"given {given:g} +- {SHARED_SPREAD:g}"
    else:
        values = {0.0, 1.0}
        why = "not in the step-model file: its whole range"
    for value in sorted(values - {given}):
        moved = dataclasses.replace(model, shared_fraction=value)
        variants.append(Variant("shared_fraction", f"shared_fraction {value:g} ({why})", moved))
    return variants


# ------------------------------------------------------------------ the evidence and the verdict
@dataclass(frozen=True)
class Sensitivity:
    variant: Variant
    on_vs_off: tuple[Change, ...]
    frozen_on: tuple[float, ...] = ()  # per seed

    @property
    def verdict(self) -> str:
        return judge(self.on_vs_off)


@dataclass(frozen=True)
class Evidence:
    """Everything the answer rests on, from the runs (a test builds it from summaries)."""

    hold: str  # the bounded-hold policy, "bounded-hold:K"
    load: float  # offered load, a multiple of dp x max_num_seqs in flight (runner.offered_load)
    gather_ms: float  # the gather's cost per step at this DP, as given
    max_num_seqs: int
    on_vs_off: tuple[Change, ...]
    hold_vs_off: tuple[Change, ...]
    hold_vs_on: tuple[Change, ...]
    frozen_on: tuple[float, ...]  # per seed
    queue_growth: dict[str, tuple[float, ...]]  # "off" / "on": metrics.queue_growth per seed
    fullest_rank_off: int  # the most requests any rank of off ran (all seeds)
    sensitivity: tuple[Sensitivity, ...]


@dataclass(frozen=True)
class Advice:
    category: Category
    lines: tuple[str, ...]


def _texts(metric_changes: Sequence[Change]) -> str:
    return ", ".join(c.text() for c in metric_changes)


def _verdict_detail(decision: str, on_vs_off: Sequence[Change]) -> str:
    better = [c for c in on_vs_off if c.judged and c.improves]
    worse = [c for c in on_vs_off if c.judged and c.worsens]
    if decision == HELPS:
        return f"Better: {_texts(better)}; nothing worse by more than {NEUTRAL_PCT:g}%."
    if decision == HURTS:
        return f"Worse: {_texts(worse)}; nothing better by more than {NEUTRAL_PCT:g}%."
    if decision == MIXED:
        return f"Better: {_texts(better)}; worse: {_texts(worse)}."
    if decision == NEUTRAL:
        return (
            f"No judged metric (TTFT p99, TTFT p50, throughput) moves by more than "
            f"{NEUTRAL_PCT:g}%, on average or on any seed in both directions."
        )
    disputed = [c for c in on_vs_off if c.judged and (c.seeds_disagree or c.straddles)]
    return f"The seeds disagree on the sign: {_texts(disputed)}."


def headline(e: Evidence) -> tuple[Category, list[str]]:
    """The category and the lines that say it, before what it rests on."""
    decision = judge(e.on_vs_off)
    if decision == UNCLEAR:
        return SEEDS_DISAGREE, [
            "Recommendation: UNCLEAR. The seeds put the change on both sides of zero by more "
            f"than {NEUTRAL_PCT:g}%: this run cannot tell whether enabling helps or hurts; run "
            "more requests (--num-requests) or more seeds (--seeds).",
            f"  {_verdict_detail(decision, e.on_vs_off)}",
        ]
    flipped = [s for s in e.sensitivity if s.verdict != decision]
    if flipped:
        terms = list(dict.fromkeys(s.variant.term for s in flipped))
        lines = [
            f"Recommendation: DEPENDS ON {' AND '.join(terms)}: the verdict changes within "
            "the range of what the step model does not know.",
            f"  With the step model as given: {OF_VERDICT[decision].word}. "
            + _verdict_detail(decision, e.on_vs_off),
        ]
        lines += [f"  With {s.variant.label}: {OF_VERDICT[s.verdict].word}." for s in flipped]
        lines += [f"  Measure {term} before deciding: {MEASURE[term]}." for term in terms]
        return DEPENDS, lines
    category = OF_VERDICT[decision]
    first = {
        HELPS: "Recommendation: ENABLE balance scheduling "
        f"(additional_config {operator_config()}).",
        HURTS: "Recommendation: DO NOT ENABLE balance scheduling.",
        MIXED: "Recommendation: TRADE-OFF. Enable balance scheduling only if what it makes "
        "better matters more to you than what it makes worse.",
        NEUTRAL: "Recommendation: NO DIFFERENCE. Leave balance scheduling off: it would cost "
        "its gather for no change this simulation can see.",
    }[decision]
    return category, [first, f"  {_verdict_detail(decision, e.on_vs_off)}"]


def _percent_range(values: Sequence[float]) -> str:
    low, high = f"{min(values):+.1%}", f"{max(values):+.1%}"
    return low if low == high else f"{low}..{high}"


def _queue_line(e: Evidence) -> str:
    grew = {p: [g for g in e.queue_growth[p] if g > QUEUE_GROWTH] for p in ("off", "on")}
    seeds = len(e.queue_growth["off"])
    if not grew["off"] and not grew["on"]:
        return (
            "Queues: off's and on's backlogs stayed steady over the run on every seed (growth "
            f"{_percent_range(e.queue_growth['off'] + e.queue_growth['on'])} of the second "
            "half's arrivals): the numbers do not grow with the run's length."
        )
    parts = [
        f"{policy}'s backlog grew on {len(grew[policy])} of {seeds} seeds (by "
        f"{_percent_range(grew[policy])} of the second half's arrivals)"
        for policy in ("off", "on")
        if grew[policy]
    ]
    overloaded = " and ".join(p for p in ("off", "on") if grew[p])
    both = grew["off"] and grew["on"]
    return (
        f"Queues: {'; '.join(parts)}: {overloaded} {'are' if both else 'is'} overloaded at this "
        "load, so TTFT numbers and the TTFT changes above grow with the run's length "
        "(--num-requests): they are this run's, not a steady state. Throughput measures "
        "capacity and does not."
    )


def basis(e: Evidence) -> list[str]:
    """What the answer rests on: the gate's frozen share, the queues, the step model, the seeds."""
    frozen = e.frozen_on
    if max(frozen) == 0:
        gate = (
            f"The gate never froze (0.0% of steps on every seed): no rank was at the cap "
            f"({e.max_num_seqs}) after any step (off's fullest rank ran {e.fullest_rank_off}), "
            f"so on admitted as off does, and the changes above are the gather's own cost "
            f"({e.gather_ms:g} ms/step) alone. "
            + (
                f"At {e.load:.2f}x offered load a longer run (--num-requests) may reach the cap: "
                "this one measured the gather only."
                if e.load >= 1.0
                else f"At {e.load:.2f}x offered load the ranks stay below the cap: the gate has "
                "nothing to do here."
            )
        )
    else:
        gate = (
            f"The gate froze admission on {sum(frozen) / len(frozen):.1%} of steps (seeds "
            f"{min(frozen):.1%}..{max(frozen):.1%}): the changes above are what holding those "
            f"admissions did, the gather's own cost ({e.gather_ms:g} ms/step) included."
        )
    lines = [gate, _queue_line(e)]
    if e.sensitivity:
        decision = judge(e.on_vs_off)
        held = all(s.verdict == decision for s in e.sensitivity)
        lines.append(
            "The step model: "
            + "; ".join(f"{s.variant.label}: {OF_VERDICT[s.verdict].word}" for s in e.sensitivity)
            + (
                ". The verdict holds over this range (docs/sim.md, advise)."
                if held
                else ". The verdict changes within this range (docs/sim.md, advise)."
            )
        )
    unsettled = [
        c for c in e.on_vs_off if c.judged and c.straddles and not (c.improves or c.worsens)
    ]
    if unsettled and judge(e.on_vs_off) != UNCLEAR:
        lines.append(f"Not settled by the seeds: {_texts(unsettled)}.")
    return ["What this rests on:"] + [f"  - {line}" for line in lines]


def operator_config(options: dict | None = None) -> str:
    """The ``additional_config`` JSON an operator passes to enable balance (and ``options``)."""
    from vllm_balance.config import ENABLE_KEY  # at call time: the CLI imports no vLLM before

    return json.dumps({ENABLE_KEY: True, **(options or {})})


def hold_lines(e: Evidence, decision: str) -> list[str]:
    """The bounded hold, labelled simulated only: what to add to (or use instead of) the gate."""
    from vllm_balance.config import MAX_FROZEN_STEPS_KEY

    steps = int(e.hold.split(":")[1])
    key = f"{MAX_FROZEN_STEPS_KEY}: {steps}"
    config = operator_config({MAX_FROZEN_STEPS_KEY: steps})
    if decision in (HELPS, MIXED):
        extra = judge(e.hold_vs_on)
        if extra == HELPS:
            text = f"also set {key}; against the plain gate: {_texts(e.hold_vs_on)}"
        else:
            text = f"{key} brings no clear gain over the plain gate ({extra}); leave it unset"
    elif judge(e.hold_vs_off) == HELPS:
        text = (
            f"the gate with {key} helps here: {_texts(e.hold_vs_off)}; enable it only with "
            f"that key (additional_config {config})"
        )
    else:
        text = f"{key} does not change that ({judge(e.hold_vs_off)})"
    return [f"Bounded hold: {text}.", f"  {HOLD_CAVEAT}"]


def advice(e: Evidence) -> Advice:
    category, lines = headline(e)
    decision = judge(e.on_vs_off)
    return Advice(category, tuple(lines + basis(e) + hold_lines(e, decision)))


# ------------------------------------------------------------------ the command
def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _print_scenario(base: SimOptions, workload, seeds: Sequence[int], load: float) -> None:
    model = base.step_model
    title = scenario_title(base, workload, seed=False)
    print(f"Scenario: {title}; seeds {','.join(map(str, seeds))}")
    print(
        f"  offered load {load_text(load)}; step model: fixed "
        f"{model.fixed_ms:g} ms, prefill {model.per_prefill_token_ms:g} ms/token, decode "
        f"{model.per_decode_request_ms:g} ms/request, shared_fraction {model.shared_fraction:g}, "
        f"gather {model.gather_cost_ms(base.dp_size):g} ms/step"
    )


def _print_status(category: Category) -> None:
    print(f"Exit status {category.status}: {category.word} (docs/sim.md, advise).")


def _print_means(summaries: dict[str, list], policies: Sequence[str]) -> None:
    print("\nMean over seeds:")
    print(
        f"  {'policy':<18}{'TTFT p99 ms':>12}{'TTFT p50 ms':>12}{'tok/s':>8}{'TPOT p50 ms':>12}"
        f"{'frozen':>8}"
    )
    for policy in policies:
        s = summaries[policy]
        print(
            f"  {policy:<18}{_mean([x.ttft_p99_ms for x in s]):>12.0f}"
            f"{_mean([x.ttft_p50_ms for x in s]):>12.0f}"
            f"{_mean([x.output_tok_per_s for x in s]):>8.0f}"
            f"{_mean([x.tpot_p50_ms for x in s]):>12.1f}"
            f"{_mean([x.frozen_fraction for x in s]):>8.1%}"
        )


def plan(
    per_seed: Sequence[SimOptions], policies: Sequence[str], variants: Sequence[Variant], rate
) -> list[tuple[tuple[str, str], Job]]:
    """Every run, keyed (variant label or "" for the model as given, policy), seeds in order.

    The variants replay the same arrivals: at the deployment's rate, whatever the model (with
    ``--concurrency`` the generated rate follows the model; it is fixed at the given one here).
    A gather variant runs ``on`` only: ``off`` does not gather, so its runs are the given's.
    """
    keyed = [
        (("", policy), Job(options, policy, keep_record=policy in ("off", "on")))
        for options in per_seed
        for policy in policies
    ]
    same_arrivals = {} if rate is None else {"rate_per_s": rate}
    for variant in variants:
        for options in per_seed:
            moved = dataclasses.replace(options, step_model=variant.model, **same_arrivals)
            for policy in ("off", "on") if variant.moves_off else ("on",):
                keyed.append(((variant.label, policy), Job(moved, policy, keep_record=False)))
    return keyed


def gather_evidence(
    runs: dict[tuple[str, str], list],
    base: SimOptions,
    load: float,
    variants: Sequence[Variant],
    hold: str,
) -> Evidence:
    """The evidence from the runs, keyed as :func:`plan` keys them."""
    from balance_sim.metrics import fullest_rank, queue_growth

    summaries = {key: [run.summary for run in found] for key, found in runs.items()}
    off, on = summaries[("", "off")], summaries[("", "on")]
    sensitivity = []
    for variant in variants:
        moved_off = summaries[(variant.label, "off")] if variant.moves_off else off
        moved_on = summaries[(variant.label, "on")]
        sensitivity.append(
            Sensitivity(
                variant,
                tuple(changes(moved_off, moved_on)),
                tuple(s.frozen_fraction for s in moved_on),
            )
        )
    return Evidence(
        hold=hold,
        load=load,
        gather_ms=base.step_model.gather_cost_ms(base.dp_size),
        max_num_seqs=base.max_num_seqs,
        on_vs_off=tuple(changes(off, on)),
        hold_vs_off=tuple(changes(off, summaries[("", hold)])),
        hold_vs_on=tuple(changes(on, summaries[("", hold)])),
        frozen_on=tuple(s.frozen_fraction for s in on),
        queue_growth={
            policy: tuple(queue_growth(run.record) for run in runs[("", policy)])
            for policy in ("off", "on")
        },
        fullest_rank_off=max(fullest_rank(run.record) for run in runs[("", "off")]),
        sensitivity=tuple(sensitivity),
    )


def _refuse(reasons: Sequence[str], before: bool) -> int:
    print("\nRecommendation: NO RECOMMENDATION. Outside what this simulation can judge:")
    print("\n".join(f"  - {reason}" for reason in reasons))
    if before:
        print("Decided before simulating: nothing was run.")
    _print_status(NO_RECOMMENDATION)
    return NO_RECOMMENDATION.status


def _print_changes(evidence: Evidence) -> None:
    print("\nChange vs off (mean, and the range over seeds; TPOT is shown, not judged: holding")
    print("admissions shortens batches, so TPOT falls whenever a policy holds):")
    print(f"  on: {_texts(evidence.on_vs_off)}")
    print(f"  {evidence.hold}: {_texts(evidence.hold_vs_off)}")
    if evidence.sensitivity:
        print("\nStep-model sensitivity, on vs off (the same arrivals):")
        for s in evidence.sensitivity:
            judged = [c for c in s.on_vs_off if c.judged]
            print(
                f"  {s.variant.label}: {OF_VERDICT[s.verdict].word} (gate froze "
                f"{_mean(s.frozen_on):.1%} of steps): {_texts(judged)}"
            )


def advise(
    args: argparse.Namespace,
    base: SimOptions,
    processes: int,
    given_keys: Collection[str] = (),
) -> int:
    """Run advise for the parsed ``args``; returns the category's exit status."""
    hold = f"bounded-hold:{args.hold_steps}"
    policies = ("off", "on", hold)
    seeds = tuple(args.seeds)
    per_seed = [dataclasses.replace(base, seed=seed) for seed in seeds]
    workload = cached_workload(per_seed[0])
    load = offered_load(base, workload)
    _print_scenario(base, workload, seeds, load)
    reasons = refusals(base, load, len(workload.arrivals))
    if reasons:
        return _refuse(reasons, before=True)

    variants = sensitivity_variants(base.step_model, base.dp_size, given_keys)
    keyed = plan(per_seed, policies, variants, None if base.trace else workload.rate_per_s)
    start = time.perf_counter()
    finished = run_jobs([job for _, job in keyed], processes, progress=not args.no_progress)
    wall = time.perf_counter() - start
    runs: dict[tuple[str, str], list] = {}
    for (key, _), run in zip(keyed, finished):
        runs.setdefault(key, []).append(run)
    print(
        f"  {len(keyed)} runs ({', '.join(policies)} x {len(seeds)} seeds, and "
        f"{len(keyed) - len(seeds) * len(policies)} for the step model's sensitivity; "
        f"{len(workload.arrivals)} requests each) in {wall:.0f} s wall, "
        f"{min(processes, len(keyed))} process(es)"
    )
    _print_means({p: [run.summary for run in runs[("", p)]] for p in policies}, policies)
    evidence = gather_evidence(runs, base, load, variants, hold)
    _print_changes(evidence)
    print()
    unfinished = sorted(
        f"{policy} {label or 'as given'}".strip()
        for (label, policy), found in runs.items()
        if any(run.summary.completed < run.summary.submitted for run in found)
    )
    if unfinished:
        return _refuse([f"runs that did not finish every request: {unfinished}"], before=False)
    answer = advice(evidence)
    print("\n".join(answer.lines))
    print(
        "\nThis is the simulator's model (docs/sim.md), not a measurement: check the step model "
        "against your deployment's step times first."
    )
    _print_status(answer.category)
    return answer.category.status
