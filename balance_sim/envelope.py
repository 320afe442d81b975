"""``vllm-balance-sim envelope``: where each policy helps, is neutral or hurts, vs ``off``.

A grid of offered load (concurrency as a multiple of ``dp x max_num_seqs``, the rate following
from the step model as for ``--concurrency``) by the step model's ``shared_fraction``; at each
point every policy and ``off`` replay the same arrivals for each seed, and :mod:`.compare`
judges each policy against ``off`` with the spread over seeds. Writes ``envelope.json`` (every
summary), ``envelope.md`` (the tables in docs/results.md) and ``envelope.png`` (heatmaps).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path

from balance_sim.compare import Change, changes, verdict
from balance_sim.markdown import markdown_table
from balance_sim.metrics import Summary
from balance_sim.parallel import Job, cached_workload, run_jobs
from balance_sim.runner import SimOptions, scenario_json

SYMBOL = {"helps": "+", "hurts": "-", "neutral": "=", "mixed": "±", "unclear": "?"}


def point_options(base: SimOptions, load: float, shared_fraction: float, seed: int) -> SimOptions:
    return dataclasses.replace(
        base,
        concurrency=max(1, round(load * base.dp_size * base.max_num_seqs)),
        rate_per_s=None,
        step_model=dataclasses.replace(base.step_model, shared_fraction=shared_fraction),
        seed=seed,
        policies=(),
    )


@dataclasses.dataclass
class Point:
    load: float
    shared_fraction: float
    rate_per_s: float
    summaries: dict[str, list]  # policy -> Summary per seed
    vs_off: dict[str, list[Change]]  # policy -> changes vs off

    def verdict(self, policy: str) -> str:
        return verdict(self.vs_off[policy])

    def change(self, policy: str, metric: str) -> Change:
        return next(c for c in self.vs_off[policy] if c.metric == metric)


def _run_file(runs_dir: Path, job: Job) -> Path:
    """Where one finished run's summary is kept: named by everything that decides it."""
    key = json.dumps([dataclasses.asdict(job.options), job.policy], sort_keys=True)
    return runs_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def sweep(
    base: SimOptions,
    loads: Sequence[float],
    fractions: Sequence[float],
    policies: Sequence[str],
    seeds: Sequence[int],
    processes: int,
    progress: bool,
    runs_dir: Path,
) -> list[Point]:
    """Every (load, fraction, seed, policy) run, each summary saved to ``runs_dir`` as it ends.

    A run already saved there is read, not repeated: an interrupted sweep resumes.
    """
    compared = ("off", *[p for p in policies if p != "off"])
    grid = [(load, fraction) for fraction in fractions for load in loads]
    jobs = [
        Job(point_options(base, load, fraction, seed), policy, keep_record=False)
        for load, fraction in grid
        for seed in seeds
        for policy in compared
    ]
    runs_dir.mkdir(parents=True, exist_ok=True)
    summaries: list[Summary | None] = [None] * len(jobs)
    for index, job in enumerate(jobs):
        path = _run_file(runs_dir, job)
        if path.is_file():
            summaries[index] = Summary(**json.loads(path.read_text()))
    missing = [i for i, summary in enumerate(summaries) if summary is None]

    def save(index: int, run) -> None:
        job_index = missing[index]
        summaries[job_index] = run.summary
        path = _run_file(runs_dir, jobs[job_index])
        path.write_text(json.dumps(dataclasses.asdict(run.summary), sort_keys=True) + "\n")

    run_jobs([jobs[i] for i in missing], processes, progress, on_result=save)
    ordered = iter(summaries)
    points = []
    for load, fraction in grid:
        by_policy: dict[str, list] = {p: [] for p in compared}
        for _seed in seeds:
            for policy in compared:
                by_policy[policy].append(next(ordered))
        rate = cached_workload(point_options(base, load, fraction, seeds[0])).rate_per_s
        vs_off = {p: changes(by_policy["off"], by_policy[p]) for p in compared[1:]}
        points.append(Point(load, fraction, rate or 0.0, by_policy, vs_off))
    return points


def _pct(change: Change) -> str:
    return f"{change.mean:+.0f}% ({change.low:+.0f}..{change.high:+.0f})"


def markdown(points: Sequence[Point], policies: Sequence[str]) -> str:
    """Two tables: every policy's verdict, then ``on``'s (or the first policy's) detail."""
    head = ["load", "shared", "req/s", "off TTFT p99 ms", "off tok/s"]
    rows = []
    for point in points:
        off = point.summaries["off"]
        cells = [
            f"{point.load:g}x",
            f"{point.shared_fraction:g}",
            f"{point.rate_per_s:.1f}",
            f"{sum(s.ttft_p99_ms for s in off) / len(off):.0f}",
            f"{sum(s.output_tok_per_s for s in off) / len(off):.0f}",
        ]
        for policy in policies:
            ttft, tok = (
                point.change(policy, "ttft_p99_ms"),
                point.change(policy, "output_tok_per_s"),
            )
            word = point.verdict(policy)
            cells.append(f"{SYMBOL[word]} {word}: {ttft.mean:+.0f}% / {tok.mean:+.1f}%")
        rows.append(cells)
    detail = policies[0]
    metrics = [c.name for c in points[0].vs_off[detail]]
    details = []
    for point in points:
        frozen = [s.frozen_fraction for s in point.summaries[detail]]
        details.append(
            [f"{point.load:g}x", f"{point.shared_fraction:g}"]
            + [_pct(c) for c in point.vs_off[detail]]
            + [f"{sum(frozen) / len(frozen):.1%}", point.verdict(detail)]
        )
    lines = [
        "Verdict vs off, then mean TTFT p99 change / throughput change over the seeds "
        "(+ helps, = neutral, - hurts, ± mixed, ? seeds disagree):",
        "",
        *markdown_table(" | ".join(head + list(policies)), rows),
        "",
        f"`{detail}` vs off in detail: mean change over the seeds (lowest..highest seed), "
        "and the fraction of steps the gate froze:",
        "",
        *markdown_table(" | ".join(["load", "shared", *metrics, "frozen", "verdict"]), details),
    ]
    return "\n".join(lines) + "\n"


WORD = {"helps": "better", "hurts": "worse", "neutral": "same", "unclear": "?"}
TICKS = (-100, -30, -10, -5, 0, 5, 10, 30, 100)


def heatmap(points: Sequence[Point], policies: Sequence[str], title: str):
    """Rows: TTFT p99 and throughput change vs off; columns: policies. Green = better.

    Each cell: the mean change over the seeds, and below it whether every seed agrees that it
    is better or worse by more than 5% ("same": within 5%; "?": large but seeds disagree).
    Colour is the benefit on a symmetric log scale, so +400% and +40% stay distinguishable.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import SymLogNorm

    loads = sorted({p.load for p in points})
    fractions = sorted({p.shared_fraction for p in points})
    rows = (("ttft_p99_ms", "TTFT p99", -1), ("output_tok_per_s", "throughput", 1))
    fig, axes = plt.subplots(
        len(rows),
        len(policies),
        figsize=(2.2 + 0.55 * len(loads) * len(policies), 1.6 + 0.5 * len(fractions) * len(rows)),
        squeeze=False,
        layout="constrained",
    )
    norm = SymLogNorm(linthresh=5, vmin=-100, vmax=100, base=10)
    for row, (metric, label, sign) in enumerate(rows):
        for col, policy in enumerate(policies):
            ax = axes[row, col]
            benefit = np.zeros((len(fractions), len(loads)))
            for point in points:
                i, j = fractions.index(point.shared_fraction), loads.index(point.load)
                change = point.change(policy, metric)
                benefit[i, j] = sign * change.mean
                ax.text(
                    j,
                    i,
                    f"{change.mean:+.0f}%\n{WORD[verdict([change])]}",
                    ha="center",
                    va="center",
                    fontsize=6.5,
                    linespacing=1.1,
                )
            image = ax.imshow(
                np.clip(benefit, -100, 100),
                cmap="RdYlGn",
                norm=norm,
                origin="lower",
                aspect="auto",
            )
            ax.set_xticks(range(len(loads)), [f"{x:g}x" for x in loads], fontsize=7)
            ax.set_yticks(range(len(fractions)), [f"{x:g}" for x in fractions], fontsize=7)
            ax.set_title(f"{policy} vs off: {label}", fontsize=8)
    fig.supxlabel("offered load: requests in flight as a multiple of dp x max_num_seqs", fontsize=8)
    fig.supylabel("step model shared_fraction", fontsize=8)
    bar = fig.colorbar(image, ax=axes, shrink=0.7, ticks=TICKS)
    bar.ax.set_yticklabels([f"{t:+d}%" if t else "0" for t in TICKS], fontsize=7)
    bar.set_label("benefit vs off (green better, red worse)", fontsize=7)
    fig.suptitle(f"Operating envelope, mean change vs off over the seeds. {title}", fontsize=8)
    return fig


def envelope(args: argparse.Namespace, base: SimOptions, processes: int) -> int:
    policies = tuple(p for p in args.policies if p != "off")
    if not policies:
        raise ValueError("envelope compares policies with off: give at least one other policy")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    points = sweep(
        base,
        args.loads,
        args.shared_fractions,
        policies,
        args.seeds,
        processes,
        not args.no_progress,
        out / "runs",
    )
    wall = time.perf_counter() - start
    document = {
        "scenario": {
            **scenario_json(base, cached_workload(point_options(base, 1.0, 0.0, 0))),
            "loads": list(args.loads),
            "shared_fractions": list(args.shared_fractions),
            "seeds": list(args.seeds),
            "policies": ["off", *policies],
        },
        "points": [
            {
                "load": p.load,
                "shared_fraction": p.shared_fraction,
                "rate_per_s": round(p.rate_per_s, 6),
                "summaries": {
                    policy: [dataclasses.asdict(s) for s in runs]
                    for policy, runs in p.summaries.items()
                },
                "verdict": {policy: p.verdict(policy) for policy in policies},
            }
            for p in points
        ],
    }
    for key in ("concurrency", "rate_per_s", "target_concurrency", "seed"):
        document["scenario"].pop(key, None)
    (out / "envelope.json").write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    table = markdown(points, policies)
    (out / "envelope.md").write_text(table)
    title = (
        f"DP={base.dp_size}, max_num_seqs={base.max_num_seqs}, prompts {base.prompt_len}, "
        f"outputs {base.output_len}, {base.num_requests} requests, seeds "
        f"{','.join(map(str, args.seeds))}, "
        f"gather {base.step_model.gather_cost_ms(base.dp_size):g} ms"
    )
    figure = heatmap(points, policies, title)
    figure.savefig(out / "envelope.png", dpi=110, bbox_inches="tight")
    print(table)
    runs = len(points) * len(args.seeds) * (len(policies) + 1)
    print(
        f"{runs} runs in {wall:.0f} s wall. Wrote envelope.json, envelope.md, envelope.png to {out}"
    )
    return 0
