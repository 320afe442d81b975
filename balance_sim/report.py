"""Output: terminal table, JSON with every number, PNG plots.

The JSON holds simulated quantities only (no wall-clock, no timestamps, no paths), so the same
seed and options give a byte-identical file.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from balance_sim.engine import RunRecord
from balance_sim.markdown import markdown_table
from balance_sim.metrics import DIGITS, Summary, tpots_s, ttfts_s

COLUMNS = (
    ("policy", "policy", "{}"),
    ("output_tok_per_s", "tok/s", "{:.0f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"),
    ("balance_ratio", "balance", "{:.3f}"),
    ("frozen_fraction", "frozen", "{:.1%}"),
    ("completed", "completed", "{}"),
)


def format_table(summaries: Sequence[Summary], markdown: bool = False) -> str:
    header = [title for _, title, _ in COLUMNS]
    rows = [[fmt.format(getattr(s, key)) for key, _, fmt in COLUMNS[:-1]] for s in summaries]
    for row, s in zip(rows, summaries):
        row.append(f"{s.completed}/{s.submitted}")
    if markdown:
        return "\n".join(markdown_table(" | ".join(header), rows))
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    fmt_row = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    return "\n".join([fmt_row(header), fmt_row(["-" * w for w in widths])] + [*map(fmt_row, rows)])


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(v, DIGITS) for v in values]


def policy_json(run: RunRecord, summary: Summary) -> dict[str, Any]:
    log = run.log
    return {
        "summary": dataclasses.asdict(summary),
        "steps": {
            "time_s": _rounded(log.time_s),
            "running_per_rank": log.running,
            "admitted_per_rank": log.admitted,
            "frozen": log.held,
        },
        "requests": {
            "ttft_s": _rounded(ttfts_s(run)),
            "tpot_s": _rounded(tpots_s(run)),
        },
    }


def write_json(path: Path, scenario: dict[str, Any], runs: Sequence[tuple[RunRecord, Summary]]):
    document = {
        "scenario": scenario,
        "policies": {summary.policy: policy_json(run, summary) for run, summary in runs},
    }
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


# Ranks drawn one line each up to this DP; above it the panel shows min / mean / max over ranks
# (eight overlapping step lines cannot be told apart, whatever their colours).
MAX_RANK_LINES = 4


def running_figure(runs: Sequence[tuple[RunRecord, Summary]], title: str = ""):
    """One panel per policy: running requests per rank over simulated time, the cap drawn.

    Up to :data:`MAX_RANK_LINES` ranks one line each (legend outside the axes, right); above,
    the band between the least and the most loaded rank and the mean, which stays readable at
    DP=256. The y axis ends above the cap so the cap line never sits on the frame.
    """
    import numpy as np

    plt = _pyplot()
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(11, 2.3 * len(runs) + 0.6), sharex=True, squeeze=False
    )
    for ax, (run, summary) in zip(axes[:, 0], runs):
        dp_size, cap = run.config.dp_size, run.config.max_num_seqs
        running = np.asarray(run.log.running).reshape(-1, dp_size)
        if dp_size <= MAX_RANK_LINES:
            colours = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, dp_size))
            for rank in range(dp_size):
                ax.plot(
                    run.log.time_s,
                    running[:, rank],
                    linewidth=0.7,
                    color=colours[rank],
                    label=f"rank {rank}",
                    drawstyle="steps-post",
                )
        else:
            ax.fill_between(
                run.log.time_s,
                running.min(axis=1),
                running.max(axis=1),
                alpha=0.3,
                step="post",
                label=f"min..max of {dp_size} ranks",
            )
            ax.plot(run.log.time_s, running.mean(axis=1), linewidth=0.8, label="mean")
        ax.axhline(cap, color="red", linestyle="--", linewidth=1.2, label=f"cap {cap}")
        ax.set_ylim(0, cap * 1.12)
        ax.set_title(
            f"{summary.policy}: frozen {summary.frozen_fraction:.1%} of steps, "
            f"balance {summary.balance_ratio:.3f}",
            fontsize=9,
            loc="left",
        )
        ax.set_ylabel("running")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.suptitle(f"Running requests per rank. {title}", fontsize=10)
    fig.tight_layout()
    return fig


def cdf_figure(runs: Sequence[tuple[RunRecord, Summary]], metric: str, title: str = ""):
    """CDF of TTFT or TPOT (ms), one line per policy; log x, and a panel for the top 10%.

    A linear axis puts the bulk of requests in a corner when one policy has a long tail; the
    right panel zooms into the fraction 0.9-1.0 where the policies differ most.
    """
    import numpy as np
    from matplotlib import ticker

    plt = _pyplot()
    values_of = {"ttft": ttfts_s, "tpot": tpots_s}[metric]
    fig, (whole, tail) = plt.subplots(1, 2, figsize=(11, 4.2))
    tail_from, tail_to = [], []
    for run, summary in runs:
        values = np.sort(np.asarray(values_of(run)) * 1000.0)
        if len(values):
            fraction = np.arange(1, len(values) + 1) / len(values)
            for ax in (whole, tail):
                ax.plot(values, fraction, label=summary.policy, linewidth=1.2)
            tail_from.append(np.percentile(values, 90))
            tail_to.append(values[-1])
    whole.set_xscale("log")
    whole.set_xlabel(f"{metric.upper()} (ms, log scale)")
    if tail_from:
        low, high = min(tail_from) * 0.95, max(tail_to) * 1.05
        # A tail spanning more than 10x reads better on a log axis, a narrow one on a linear one.
        if high / low > 10:
            tail.set_xscale("log")
        tail.set_xlim(low, high)
    tail.set_xlabel(f"{metric.upper()} (ms{', log scale' if tail.get_xscale() == 'log' else ''})")
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    for ax, subs in ((whole, (1.0, 2.0, 5.0)), (tail, (1.0, 1.5, 2.0, 3.0, 5.0, 7.0))):
        # The zoomed panel spans less than a decade or two: denser labels, so that its low end
        # (a few hundred ms) is labelled too.
        if ax.get_xscale() == "log":
            ax.xaxis.set_major_locator(ticker.LogLocator(subs=subs))
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.grid(alpha=0.3, which="both")
    whole.set_ylabel("fraction of requests")
    whole.set_title("all requests", fontsize=9)
    tail.set_ylim(0.9, 1.001)
    tail.set_title("the slowest 10%", fontsize=9)
    tail.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{metric.upper()} CDF. {title}", fontsize=10)
    fig.tight_layout()
    return fig


def write_plots(
    out_dir: Path, runs: Sequence[tuple[RunRecord, Summary]], title: str = ""
) -> list[Path]:
    plt = _pyplot()
    figures = {
        "running_per_rank.png": running_figure(runs, title),
        "ttft_cdf.png": cdf_figure(runs, "ttft", title),
        "tpot_cdf.png": cdf_figure(runs, "tpot", title),
    }
    paths = []
    for name, fig in figures.items():
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
