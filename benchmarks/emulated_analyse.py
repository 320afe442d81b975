"""``nox -s bench-emulated``'s analysis: which runs count (CPU headroom), each run's observations
from the step records, and per (DP size, device) group the measured table, the simulator on the
same requests, the on/off ratios with their bootstrap intervals, the verdicts and advise's answer.

It returns frozen msgspec structs (``GroupResult`` and its parts, ``serve_report``'s
``SummaryPart``s) for ``emulated_render``; they become summary.json's ``groups`` through
``to_json`` (and back through ``from_json``) in exactly the layout that file has always had: a
field left unset is absent there, not ``null``. The tables (measured, simulated) and the fitted
step model are ``serve_report``'s typed results.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import msgspec

from benchmarks.emulated_measure import (
    ADVISE_JOBS,
    MAX_NUM_SEQS,
    OUTPUT_LEN,
    PROMPT_LEN,
    SIM_ARGS,
    WORKLOAD,
    headroom,
    run_records,
)
from benchmarks.serve_report import MeasuredTable, SimTable, StepModel, SummaryPart

# The metrics each policy is compared on: each is a field of ``RatioRow`` (and a key of its JSON).
RATIO_KEYS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")


# ------------------------------------------------------------------------ the typed results
class Ratio(SummaryPart):
    """One metric of a policy against its base: measured; simulated and whether the two agree
    (within ``AGREE``) where the simulator ran; for the per-request metrics the measured
    ratio's bootstrap interval and whether it holds the simulated one."""

    measured: float
    simulated: float | None = None
    agree: bool | None = None
    interval: tuple[float, float] | None = None
    in_interval: bool | None = None


class Verdict(SummaryPart):
    """A measured change judged by advise's rule, over this many paired repeats."""

    category: str
    repeats: int
    changes: str


class RatioRow(SummaryPart):
    """``policy`` vs ``base`` at one rate: each of ``RATIO_KEYS`` (a field each, as summary.json
    has them beside the others; ``ratios`` gathers them), the verdict (None: no paired repeats)
    and whether the gate freezes there, measured or simulated."""

    policy: str
    base: str
    rate: str
    measured_verdict: Verdict | None
    freezes: bool
    tok_s: Ratio
    ttft_p50_ms: Ratio
    ttft_p99_ms: Ratio
    tpot_p50_ms: Ratio

    @property
    def ratios(self) -> dict[str, Ratio]:
        return {key: getattr(self, key) for key in RATIO_KEYS}


class AdviseVerdict(SummaryPart):
    """``vllm-balance-sim advise`` on the measured scenario: its exit status and category, a
    DEPENDS answer's verdict with the step model as given, and the lines of its answer."""

    status: int
    category: str
    as_given: str | None
    line: str
    hold: str | None
    offered_load: str | None


class Cell(SummaryPart):
    """One policy at one rate: means over the valid runs, and each run's worst CPU share and
    machine load; ``valid`` is "valid runs/runs"."""

    valid: str
    frozen: float | None
    balance: float | None
    overrun: float | None
    cpu_share: tuple[float, ...]
    load: tuple[list[float], ...]  # each run's machine load (1-min average) at start, end


# GroupResult's lists of ``RatioRow``s.
ROW_LISTS = ("ratios", "hold_vs_on", "ratios_least_loaded")


class GroupResult(SummaryPart):
    """One (DP size, device) group's analysis; each part after ``observed`` is None where the
    group has no data for it (no valid run, no valid ``off`` run, advise not asked).

    A row's ``measured_verdict`` of None is ``{}`` in summary.json, neither of msgspec's two
    ways with None (``null``, or absent where None is the default): ``to_json`` and
    ``from_json`` map it in ``ROW_LISTS``.
    """

    observed: dict[str, dict[str, Cell]]
    measured: MeasuredTable | None = None
    step_model: StepModel | None = None
    simulated: SimTable | None = None  # vLLM 0.30's router
    simulated_least_loaded: SimTable | None = None  # the same, vLLM <= 0.26's router
    ratios: tuple[RatioRow, ...] | None = None
    hold_vs_on: tuple[RatioRow, ...] | None = None
    ratios_least_loaded: tuple[RatioRow, ...] | None = None
    advise: dict[str, AdviseVerdict] | None = None

    def to_json(self) -> dict:
        data = super().to_json()
        for name in ROW_LISTS:
            for row in data.get(name, ()):
                row["measured_verdict"] = row["measured_verdict"] or {}
        return data

    @classmethod
    def from_json(cls, data: dict) -> GroupResult:
        def unjudged_as_none(row: dict) -> dict:
            return row | {"measured_verdict": row["measured_verdict"] or None}

        rows = {name: list(map(unjudged_as_none, data[name])) for name in ROW_LISTS if name in data}
        return super().from_json(data | rows)


# ------------------------------------------------------------------------ the runs
def valid_runs(runs: list[dict]) -> list[dict]:
    """The runs the means are taken over: those with the CPU headroom the emulation needs."""
    return [run for run in runs if run["headroom"]["valid"]]


def overrun(steps: list[dict]) -> float | None:
    """Median over lockstep steps of period / the slowest rank's emulated time, minus 1: what the
    real server added to the emulated step (collectives, host work, scheduling delay)."""
    ratios = [
        s["period_ms"] / max(s["device_ms"]) - 1.0
        for s in steps
        if "device_ms" in s and max(s["device_ms"]) > 0
    ]
    return round(statistics.median(ratios), 3) if ratios else None


def run_observations(out: Path, runs: list[dict]) -> None:
    """Each run's headroom, frozen share, rank imbalance and overrun from the step records."""
    from balance_sim.metrics import balance_ratio
    from benchmarks.serve_report import cluster_steps, in_run, load_steps

    for label in sorted({run["server"] for run in runs}):
        records = load_steps(out, label)
        steps = cluster_steps([dict(r) for r in records])
        for run in (r for r in runs if r["server"] == label):
            mine = in_run(steps, run)
            run["headroom"] = headroom(run_records(records, run))
            run["cores"] = round(run["server_cpu_s"] / (run["t1"] - run["t0"]), 2)
            run["frozen"] = round(sum(s["held"] for s in mine) / len(mine), 4) if mine else None
            running = [s["running"] for s in mine if "running" in s]
            run["balance"] = round(balance_ratio(running), 4) if running else None
            run["overrun"] = overrun(mine)
            run["steps"] = len(mine)


# ------------------------------------------------------------------------ the groups
def groups(runs: list[dict]) -> list[tuple[int, str]]:
    """(DP size, device) of the runs, each analysed on its own."""
    return sorted({(run["dp"], run["device"]) for run in runs})


AGREE = 0.2  # the goal: measured and simulated on/off ratios within 20%
FREEZES = 0.01  # "where the gate freezes": at least 1% of steps frozen, measured or simulated


def group_model(steps: dict, runs: list[dict]) -> StepModel:
    """serve_report's fit on off's steps, and balance on's measured per-step cost: the median
    time outside ``_process_engine_step`` (where the gather sits), on minus off."""
    from benchmarks.serve_report import fit_step_model, in_run

    def of(policy: str) -> list[dict]:
        chosen = [r for r in runs if r["policy"] == policy]
        return [s for run in chosen for s in in_run(steps[run["server"]], run)]

    model = fit_step_model(of("off"))
    gaps = {policy: [s["gap_ms"] for s in of(policy)] for policy in ("off", "on")}
    if gaps["off"] and gaps["on"]:
        delta = statistics.median(gaps["on"]) - statistics.median(gaps["off"])
        model = msgspec.structs.replace(model, gather_ms=round(max(delta, 0.0), 3))
    return model


# The per-request metrics whose measured ratio gets a bootstrap interval: (per-request values,
# percentile), as ``vllm bench serve`` computes them.
INTERVAL_KEYS = {
    "ttft_p50_ms": ("ttft", 50),
    "ttft_p99_ms": ("ttft", 99),
    "tpot_p50_ms": ("tpot", 50),
}
INTERVAL = 0.9


def request_values(out: Path, runs: list[dict]) -> dict:
    """Each successful request's TTFT and TPOT (ms) of ``runs`` (their repeats in order), from
    the client's detailed result files; TPOT as ``vllm bench serve`` takes it: (latency - TTFT)
    / (output tokens - 1)."""
    import numpy as np

    ttft, tpot = [], []
    for run in sorted(runs, key=lambda r: r["repeat"]):
        result = json.loads((out / run["file"]).read_text())
        for error, first, latency, tokens in zip(
            result["errors"], result["ttfts"], result["latencies"], result["output_lens"]
        ):
            if not error and tokens > 1:
                ttft.append(first * 1000.0)
                tpot.append((latency - first) * 1000.0 / (tokens - 1))
    return {"ttft": np.array(ttft), "tpot": np.array(tpot)}


def bootstrap_ratio(base, other, q: float, draws: int = 2000, seed: int = 0) -> list[float]:
    """The ``INTERVAL`` bootstrap interval of percentile ``q`` of ``other`` / of ``base``.

    Every run serves the same requests in the same order (one seed), so where both hold the
    same number the resampling is paired (request i of both in each draw): the interval is then
    the noise of a percentile of this many requests (a p99 of 200 is its 2nd-largest value), not
    of which requests were drawn.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(base), (draws, len(base)))
    paired = len(other) == len(base)
    other_picks = picks if paired else rng.integers(0, len(other), (draws, len(other)))
    ratios = np.percentile(other[other_picks], q, axis=1) / np.percentile(base[picks], q, axis=1)
    tail = (1.0 - INTERVAL) / 2.0
    return [round(float(x), 3) for x in np.quantile(ratios, [tail, 1.0 - tail])]


def ratio_rows(
    out: Path,
    table: MeasuredTable,
    simulated: SimTable,
    observed: dict[str, dict[str, Cell]],
    runs: list[dict],
    base: str = "off",
) -> tuple[RatioRow, ...]:
    """Each other policy vs ``base`` per rate, measured (with the bootstrap interval of the
    per-request metrics) and simulated, and whether they agree; and the measured change judged
    as advise judges (``measured_verdict``)."""
    rows = []
    for policy, cells in table.items():
        if policy in ("off", base):
            continue
        for rate in sorted(cells, key=float):
            if rate not in table.get(base, {}):
                continue
            sim, sim_off = simulated.get(policy, {}).get(rate), simulated.get(base, {}).get(rate)
            verdict = measured_verdict(runs, policy, base, rate)
            frozen = [observed[policy][rate].frozen, sim.frozen if sim else 0.0]
            values = {
                name: request_values(
                    out, [r for r in runs if r["policy"] == name and f"{r['rate']:g}" == rate]
                )
                for name in (base, policy)
            }
            ratios = {}
            for key in RATIO_KEYS:
                measured = getattr(cells[rate], key).mean / getattr(table[base][rate], key).mean
                simulated_ratio = agree = None
                if sim and sim_off and getattr(sim_off, key):
                    sim_ratio = getattr(sim, key) / getattr(sim_off, key)
                    simulated_ratio = round(sim_ratio, 3)
                    agree = abs(measured / sim_ratio - 1.0) <= AGREE
                interval = in_interval = None
                if key in INTERVAL_KEYS:
                    metric, q = INTERVAL_KEYS[key]
                    low, high = bootstrap_ratio(values[base][metric], values[policy][metric], q)
                    interval = (low, high)
                    if simulated_ratio is not None:
                        in_interval = low <= simulated_ratio <= high
                ratios[key] = Ratio(
                    round(measured, 3), simulated_ratio, agree, interval, in_interval
                )
            freezes = max(f or 0.0 for f in frozen) >= FREEZES
            rows.append(RatioRow(policy, base, rate, verdict, freezes, **ratios))
    return tuple(rows)


def measured_verdict(runs: list[dict], policy: str, base: str, rate: str) -> Verdict | None:
    """``policy`` vs ``base`` at ``rate`` judged by advise's own rule (``compare``, seeds that
    straddle zero unclear), with the measured repeats as its seeds (repeat i vs repeat i)."""
    from types import SimpleNamespace

    from balance_sim.advise import OF_VERDICT, judge
    from balance_sim.compare import changes

    def summaries(name: str) -> dict[int, SimpleNamespace]:
        chosen = [r for r in runs if r["policy"] == name and f"{r['rate']:g}" == rate]
        return {
            r["repeat"]: SimpleNamespace(
                ttft_p99_ms=r["result"]["ttft_p99_ms"],
                ttft_p50_ms=r["result"]["ttft_p50_ms"],
                output_tok_per_s=r["result"]["tok_s"],
                tpot_p50_ms=r["result"]["tpot_p50_ms"],
            )
            for r in chosen
        }

    left, right = summaries(base), summaries(policy)
    paired = sorted(set(left) & set(right))
    if not paired:
        return None
    found = changes([left[i] for i in paired], [right[i] for i in paired])
    return Verdict(
        category=OF_VERDICT[judge(found)].word,
        repeats=len(paired),
        changes=", ".join(c.text().replace("seeds", "repeats") for c in found),
    )


def advise_verdict(
    dp: int, rate: float, model: StepModel, out: Path, requests: int
) -> AdviseVerdict:
    """``vllm-balance-sim advise`` on the measured scenario (DP, cap, lengths, rate, the fitted
    step model with ``shared_fraction`` 0, which the emulation makes exact): its category."""
    from balance_sim.advise import CATEGORIES

    keys = ("fixed_ms", "per_prefill_token_ms", "per_decode_request_ms", "per_kv_token_ms",
            "gather_ms")  # fmt: skip
    model_file = out / "advise_step_model.json"
    fields = model.to_json()
    model_file.write_text(
        json.dumps({k: fields[k] for k in keys if k in fields} | {"shared_fraction": 0.0}) + "\n"
    )
    command = [
        sys.executable, "-m", "balance_sim", "advise", "--dp", str(dp),
        "--max-num-seqs", str(MAX_NUM_SEQS), "--rate", str(rate),
        "--prompt-len", PROMPT_LEN, "--output-len", OUTPUT_LEN,
        "--num-requests", str(requests), "--step-model", str(model_file),
        "--no-progress", "--jobs", str(ADVISE_JOBS), *SIM_ARGS,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    (out / f"advise_r{rate:g}.txt").write_text(result.stdout + result.stderr)
    words = {category.status: category.word for category in CATEGORIES}
    lines = [line.strip() for line in result.stdout.splitlines()]

    def first(prefix: str) -> str | None:
        return next((line for line in lines if line.startswith(prefix)), None)

    as_given = first("With the step model as given:")  # a DEPENDS answer's own verdict
    return AdviseVerdict(
        status=result.returncode,
        category=words.get(result.returncode, "error"),
        as_given=as_given.split(":")[1].split(".")[0].strip() if as_given else None,
        line=first("Recommendation:") or result.stderr.strip()[-300:],
        hold=first("Bounded hold:"),
        offered_load=first("offered load"),
    )


def observed_cells(runs: list[dict]) -> dict[str, dict[str, Cell]]:
    """policy -> rate -> frozen share, imbalance, worst CPU share (means over the valid runs)
    and how many of the cell's runs were valid."""
    cells: dict = {}
    for run in runs:
        cells.setdefault(run["policy"], {}).setdefault(f"{run['rate']:g}", []).append(run)
    result: dict[str, dict[str, Cell]] = {}
    for policy, by_rate in cells.items():
        for rate, chosen in by_rate.items():
            valid = valid_runs(chosen)

            def mean(key, runs=valid):
                values = [r[key] for r in runs if r.get(key) is not None]
                return round(statistics.fmean(values), 4) if values else None

            result.setdefault(policy, {})[rate] = Cell(
                valid=f"{len(valid)}/{len(chosen)}",
                frozen=mean("frozen"),
                balance=mean("balance"),
                overrun=mean("overrun"),
                cpu_share=tuple(r["headroom"]["cpu_share_worst"] for r in chosen),
                load=tuple(r["load"] for r in chosen),
            )
    return result


def analyse_group(
    out: Path, name: str, dp: int, runs: list[dict], advise_loads: tuple[float, ...]
) -> GroupResult:
    from benchmarks.serve_report import cluster_steps, load_steps, measured, simulate

    observed = observed_cells(runs)
    valid = valid_runs(runs)
    if not valid:
        return GroupResult(observed)
    table = measured(out, valid)
    steps = {label: cluster_steps(load_steps(out, label)) for label in {r["server"] for r in valid}}
    if not any(r["policy"] == "off" for r in valid):
        return GroupResult(observed, table)
    model = group_model(steps, valid)
    seed = WORKLOAD.seed
    sim_dir = out / "sim" / name
    simulated = simulate(out, valid, model, MAX_NUM_SEQS, seed, dp, SIM_ARGS, sim_dir)
    # The same requests with vLLM <= 0.26's balancer (the simulator's default router): which of
    # the two routers the measured imbalance and ratios follow (docs/results.md).
    old_dir = out / "sim" / f"{name}-least-loaded"
    budget = SIM_ARGS[:2]
    least_loaded = simulate(out, valid, model, MAX_NUM_SEQS, seed, dp, budget, old_dir)
    ratios = ratio_rows(out, table, simulated, observed, valid)
    hold_vs_on = ratio_rows(out, table, simulated, observed, valid, base="on")
    ratios_least_loaded = ratio_rows(out, table, least_loaded, observed, valid)
    advise = None
    if advise_loads:
        advise = {}
        for rate in sorted({r["rate"] for r in valid if r["knee"] in advise_loads}):
            requests = max(200, max(r["num_prompts"] for r in valid if r["rate"] == rate))
            verdict = advise_verdict(dp, rate, model, sim_dir, requests)
            advise[f"{rate:g}"] = verdict
            print(f"[{name}] advise at {rate:g} req/s: {verdict.category}", flush=True)
    return GroupResult(
        observed=observed,
        measured=table,
        step_model=model,
        simulated=simulated,
        simulated_least_loaded=least_loaded,
        ratios=ratios,
        hold_vs_on=hold_vs_on,
        ratios_least_loaded=ratios_least_loaded,
        advise=advise,
    )
