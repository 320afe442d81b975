"""``vllm-balance-sim`` / ``python -m vllm_balance.sim``: compare DP admission policies.

Runs N DP ranks of the installed vLLM's real scheduler in one process, replays one workload
under each policy, prints a table and writes ``sim.json`` and PNG plots to ``--out``.
See docs/sim.md for the model and every option.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vllm_balance.sim.policies import DEFAULT_POLICIES
from vllm_balance.sim.router import STALENESS_MODES
from vllm_balance.sim.runner import SimOptions, quiet_vllm_logs, show_balance_log_lines
from vllm_balance.sim.stepmodel import StepModelError, StepTimeModel, load_step_model
from vllm_balance.sim.workload import WorkloadError

DEFAULTS = SimOptions()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-balance-sim",
        description="DP balance scheduling simulator on the installed vLLM's real scheduler.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add("--dp", type=int, default=DEFAULTS.dp_size, help="data-parallel ranks")
    add("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs, help="per-rank running cap")
    add("--max-num-batched-tokens", type=int, default=DEFAULTS.max_num_batched_tokens)
    add("--num-requests", type=int, default=DEFAULTS.num_requests)
    add("--concurrency", type=int, help="target in-flight requests (default dp * max-num-seqs)")
    add("--rate", type=float, help="arrivals per second (overrides --concurrency)")
    add("--arrivals", choices=("poisson", "bursty"), default=DEFAULTS.arrivals)
    add("--burstiness", type=float, default=DEFAULTS.burstiness, help="gamma shape for bursty")
    add(
        "--prompt-len", default=DEFAULTS.prompt_len, help="fixed:N | uniform:LO:HI | longtail:M[:S]"
    )
    add("--output-len", default=DEFAULTS.output_len, help="same forms as --prompt-len")
    add("--trace", help="JSONL: arrival_time (s), prompt_len, output_len per line")
    add("--router", choices=("least-loaded", "round-robin"), default=DEFAULTS.router)
    add("--staleness", choices=STALENESS_MODES, default=DEFAULTS.staleness)
    add("--snapshot-interval-ms", type=float, default=DEFAULTS.snapshot_interval_ms)
    add(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated: off, on, cap-1, vllm-cadence[:N], trtllm-adp[:T[:W]], "
        "bounded-hold:K",
    )
    add("--seed", type=int, default=DEFAULTS.seed)
    add("--num-gpu-blocks", type=int, help="KV blocks per rank (default: never preempts)")
    add("--step-model", help="JSON/TOML file overriding step-time model keys")
    add("--out", default="out/sim", help="directory for sim.json and the PNGs")
    add(
        "--balance-log-interval-s",
        type=float,
        default=0.0,
        help="print the product's per-rank 'Balance DPn' log line every N wall seconds (0 = off)",
    )
    add("--no-plots", action="store_true")
    add("--no-progress", action="store_true")
    return p


def options_from_args(args: argparse.Namespace) -> SimOptions:
    step_model = load_step_model(args.step_model) if args.step_model else StepTimeModel()
    return SimOptions(
        dp_size=args.dp,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        rate_per_s=args.rate,
        arrivals=args.arrivals,
        burstiness=args.burstiness,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        trace=args.trace,
        router=args.router,
        staleness=args.staleness,
        snapshot_interval_ms=args.snapshot_interval_ms,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        seed=args.seed,
        num_gpu_blocks=args.num_gpu_blocks,
        step_model=step_model,
    )


def simulate(options: SimOptions, out_dir: Path, plots: bool = True, progress: bool = True):
    """Run every policy on one workload; write sim.json (+ PNGs). Returns the PolicyRuns."""
    from tqdm import tqdm

    from vllm_balance.sim.policies import make_policy
    from vllm_balance.sim.report import format_table, write_json, write_plots
    from vllm_balance.sim.runner import build_workload, run_policy, scenario_json

    for spec in options.policies:
        make_policy(spec)  # reject a bad spec before minutes of simulation
    workload = build_workload(options)
    out_dir.mkdir(parents=True, exist_ok=True)
    total = len(workload.arrivals) * len(options.policies)
    bar = tqdm(total=total, unit="req", disable=not progress or None, file=sys.stderr)
    runs = []
    for spec in options.policies:
        bar.set_description(spec)
        seen = [0]

        def on_step(cluster, seen=seen):
            bar.update(cluster.completed - seen[0])
            seen[0] = cluster.completed

        runs.append(run_policy(options, spec, workload, on_step))
    bar.close()
    pairs = [(run.cluster, run.summary) for run in runs]
    write_json(out_dir / "sim.json", scenario_json(options, workload), pairs)
    if plots:
        write_plots(out_dir, pairs)
    print(format_table([run.summary for run in runs]))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_vllm_logs()
    if args.balance_log_interval_s:
        show_balance_log_lines(args.balance_log_interval_s)
    try:
        options = options_from_args(args)
        start = time.perf_counter()
        runs = simulate(options, Path(args.out), not args.no_plots, not args.no_progress)
    except (WorkloadError, StepModelError, ValueError) as exc:
        print(f"vllm-balance-sim: error: {exc}", file=sys.stderr)
        return 2
    steps = sum(run.summary.steps for run in runs)
    sim_wall = sum(run.wall_s for run in runs)
    print(
        f"\n{steps} simulated steps in {sim_wall:.1f} s ({steps / sim_wall:.0f} steps/s, DP="
        f"{options.dp_size}); total {time.perf_counter() - start:.1f} s. "
        f"Wrote {Path(args.out) / 'sim.json'}" + ("" if args.no_plots else " and PNGs")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
