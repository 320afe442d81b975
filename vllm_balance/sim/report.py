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

from vllm_balance.sim.engine import Cluster
from vllm_balance.sim.metrics import DIGITS, Summary, tpots_s, ttfts_s

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
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    fmt_row = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    return "\n".join([fmt_row(header), fmt_row(["-" * w for w in widths])] + [*map(fmt_row, rows)])


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(v, DIGITS) for v in values]


def policy_json(cluster: Cluster, summary: Summary) -> dict[str, Any]:
    log = cluster.log
    return {
        "summary": dataclasses.asdict(summary),
        "steps": {
            "time_s": _rounded(log.time_s),
            "running_per_rank": log.running,
            "admitted_per_rank": log.admitted,
            "frozen": log.held,
        },
        "requests": {
            "ttft_s": _rounded(ttfts_s(cluster)),
            "tpot_s": _rounded(tpots_s(cluster)),
        },
    }


def write_json(path: Path, scenario: dict[str, Any], runs: Sequence[tuple[Cluster, Summary]]):
    document = {
        "scenario": scenario,
        "policies": {summary.policy: policy_json(c, summary) for c, summary in runs},
    }
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def running_figure(runs: Sequence[tuple[Cluster, Summary]]):
    """One panel per policy, one line per rank: running requests over simulated time."""
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(10, 2.4 * len(runs)), sharex=True, squeeze=False
    )
    for ax, (cluster, summary) in zip(axes[:, 0], runs):
        dp_size = cluster.config.dp_size
        for rank in range(dp_size):
            series = [row[rank] for row in cluster.log.running]
            ax.plot(cluster.log.time_s, series, linewidth=0.8, label=f"rank {rank}")
        ax.axhline(cluster.config.max_num_seqs, color="black", linestyle=":", linewidth=0.8)
        ax.set_title(f"{summary.policy}: running per rank (dotted: max_num_seqs)", fontsize=9)
        ax.set_ylabel("running")
        if dp_size <= 16:
            ax.legend(fontsize=6, ncol=8, loc="lower right")
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    return fig


def cdf_figure(runs: Sequence[tuple[Cluster, Summary]], metric: str):
    """CDF of TTFT or TPOT (ms), one line per policy."""
    import numpy as np

    plt = _pyplot()
    values_of = {"ttft": ttfts_s, "tpot": tpots_s}[metric]
    fig, ax = plt.subplots(figsize=(7, 4))
    for cluster, summary in runs:
        values = np.sort(np.asarray(values_of(cluster)) * 1000.0)
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=summary.policy)
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{metric.upper()} CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_plots(out_dir: Path, runs: Sequence[tuple[Cluster, Summary]]) -> list[Path]:
    plt = _pyplot()
    figures = {
        "running_per_rank.png": running_figure(runs),
        "ttft_cdf.png": cdf_figure(runs, "ttft"),
        "tpot_cdf.png": cdf_figure(runs, "tpot"),
    }
    paths = []
    for name, fig in figures.items():
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
