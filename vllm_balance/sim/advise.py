"""``vllm-balance-sim advise``: should this deployment enable balance scheduling?

An operator gives what they can measure (DP, ``max_num_seqs``, request rate or concurrency,
length distributions or a trace, a step-model file with their per-rank and shared costs). The
simulator runs ``off``, ``on`` and the bounded hold over a few seeds on exactly that scenario
and recommends one of: enable, do not enable, no difference, or a named trade-off, with the
predicted change per metric and its spread over the seeds (judged by :mod:`.compare`, the same
rule as docs/results.md's operating envelope).

It refuses to recommend (and says why) where its numbers would not mean anything:

- DP below 2: balance needs more than one rank to act on;
- too few requests for a p99 (fewer than :data:`MIN_REQUESTS`);
- offered load above the envelope (:data:`MAX_LOAD` x ``dp x max_num_seqs``): every policy's
  queue grows for as long as the overload lasts, so the difference is the run length's;
- a run that did not finish every request;
- seeds that disagree: a large average change with seeds on both sides of zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence

from vllm_balance.sim.compare import (
    HELPS,
    HURTS,
    MIXED,
    NEUTRAL_PCT,
    UNCLEAR,
    Change,
    changes,
    verdict,
)
from vllm_balance.sim.parallel import Job, cached_workload, run_jobs
from vllm_balance.sim.runner import SimOptions, offered_load, scenario_title

MIN_REQUESTS = 200
MAX_LOAD = 1.6  # the top of docs/results.md's operating envelope

ENABLE = '{"enable_balance_scheduling": true}'


def _line(label: str, metric_changes: Sequence[Change]) -> str:
    return f"  {label}: " + ", ".join(c.text() for c in metric_changes)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def limits(options: SimOptions, load: float, summaries: dict[str, list]) -> list[str]:
    """Why the simulation cannot support a recommendation here (empty: it can)."""
    reasons = []
    if options.dp_size < 2:
        reasons.append("DP is 1: balance acts across data-parallel ranks and needs at least 2")
    submitted = summaries["off"][0].submitted
    if submitted < MIN_REQUESTS:
        reasons.append(
            f"{submitted} requests per run: a TTFT p99 needs at least {MIN_REQUESTS} "
            "(--num-requests, or a longer trace)"
        )
    if load > MAX_LOAD:
        reasons.append(
            f"the offered load is {load:.2f}x what dp x max_num_seqs holds (the checked envelope "
            f"ends at {MAX_LOAD}x): every policy's queue grows for as long as the overload "
            "lasts, so the difference measures the run length, not the policy"
        )
    unfinished = sorted(
        {s.policy for runs in summaries.values() for s in runs if s.completed < s.submitted}
    )
    if unfinished:
        reasons.append(f"runs that did not finish every request: {unfinished}")
    return reasons


def recommendation(
    on_vs_off: Sequence[Change],
    hold_vs_off: Sequence[Change],
    hold_vs_on: Sequence[Change],
    hold: str,
    frozen_on: float,
) -> list[str]:
    """The verdict in words: what to set and why, the bounded hold last."""
    steps = int(hold.split(":")[1])
    hold_key = f"balance_max_frozen_steps: {steps}"
    held_config = json.dumps({"enable_balance_scheduling": True, "balance_max_frozen_steps": steps})
    better = [c.text() for c in on_vs_off if c.judged and c.improves]
    worse = [c.text() for c in on_vs_off if c.judged and c.worsens]
    decision = verdict(on_vs_off)
    if decision == HELPS:
        lines = [
            f"Recommendation: ENABLE balance scheduling (additional_config {ENABLE}).",
            f"  Better: {', '.join(better)}; nothing worse by more than {NEUTRAL_PCT:g}%.",
        ]
    elif decision == HURTS:
        lines = [
            "Recommendation: DO NOT ENABLE balance scheduling.",
            f"  Worse: {', '.join(worse)}; nothing better by more than {NEUTRAL_PCT:g}%.",
        ]
    elif decision == MIXED:
        lines = [
            "Recommendation: TRADE-OFF. Enabling balance scheduling makes "
            f"{', '.join(better)} better and {', '.join(worse)} worse; enable it only if the "
            "first matters more to you.",
        ]
    else:  # NEUTRAL (UNCLEAR is stopped by the caller)
        lines = [
            "Recommendation: NO DIFFERENCE. Enabling balance scheduling changes neither TTFT nor "
            "throughput by "
            f"more than {NEUTRAL_PCT:g}% (the gate froze admission on {frozen_on:.1%} of steps);"
            " it buys nothing at this load, so leave it off.",
        ]
    if decision in (HELPS, MIXED):
        extra = verdict(hold_vs_on)
        if extra == HELPS:
            lines.append(
                f"  Bounded hold: also set {hold_key}; against the plain gate: "
                + ", ".join(c.text() for c in hold_vs_on)
            )
        else:
            lines.append(
                f"  Bounded hold ({hold_key}): no clear gain over the plain gate "
                f"({extra}); leave it unset."
            )
    elif verdict(hold_vs_off) == HELPS:
        lines.append(
            f"  Bounded hold: the gate with {hold_key} does help here: "
            + ", ".join(c.text() for c in hold_vs_off)
            + f"; enable it only with that key (additional_config {held_config})."
        )
    else:
        lines.append(f"  Bounded hold ({hold_key}) does not change that ({verdict(hold_vs_off)}).")
    return lines


def advise(args: argparse.Namespace, base: SimOptions, processes: int) -> int:
    hold = f"bounded-hold:{args.hold_steps}"
    policies = ("off", "on", hold)
    seeds = tuple(args.seeds)
    per_seed = [dataclasses.replace(base, seed=seed) for seed in seeds]
    jobs = [Job(options, policy, keep_record=False) for options in per_seed for policy in policies]
    start = time.perf_counter()
    runs = run_jobs(jobs, processes, progress=not args.no_progress)
    wall = time.perf_counter() - start
    summaries = {p: [r.summary for r, j in zip(runs, jobs) if j.policy == p] for p in policies}

    workload = cached_workload(per_seed[0])
    load = offered_load(base, workload)
    model = base.step_model
    title = scenario_title(base, workload, seed=False)
    print(f"Scenario: {title}; seeds {','.join(map(str, seeds))}")
    print(
        f"  offered load {load:.2f}x dp x max_num_seqs in flight; step model: fixed "
        f"{model.fixed_ms:g} ms, prefill {model.per_prefill_token_ms:g} ms/token, decode "
        f"{model.per_decode_request_ms:g} ms/request, shared_fraction {model.shared_fraction:g}, "
        f"gather {model.gather_cost_ms(base.dp_size):g} ms/step"
    )
    requests = summaries["off"][0].submitted
    print(
        f"  {len(jobs)} runs ({', '.join(policies)} x {len(seeds)} seeds, {requests} requests "
        f"each) in {wall:.0f} s wall, {min(processes, len(jobs))} process(es)"
    )
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
    on_vs_off = changes(summaries["off"], summaries["on"])
    hold_vs_off = changes(summaries["off"], summaries[hold])
    hold_vs_on = changes(summaries["on"], summaries[hold])
    print("\nChange vs off (mean, and the range over seeds; TPOT is shown, not judged: holding")
    print("admissions shortens batches, so TPOT falls whenever a policy holds):")
    print(_line("on", on_vs_off))
    print(_line(hold, hold_vs_off))
    print()
    reasons = limits(base, load, summaries)
    if verdict(on_vs_off) == UNCLEAR:
        disagree = [c.text() for c in on_vs_off if c.judged and c.seeds_disagree]
        reasons.append(
            f"the seeds disagree ({'; '.join(disagree)}): run more requests or more seeds"
        )
    if reasons:
        print("Outside what this simulation can judge; no recommendation:")
        for reason in reasons:
            print(f"  - {reason}")
        return 0
    frozen_on = _mean([x.frozen_fraction for x in summaries["on"]])
    for line in recommendation(on_vs_off, hold_vs_off, hold_vs_on, hold, frozen_on):
        print(line)
    print(
        "\nThis is the simulator's model (docs/sim.md), not a measurement: check the step model "
        "against your deployment's step times first."
    )
    return 0
