"""One simulator run: build the workload once, replay it under each policy, collect results."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from balance_sim.policies import DEFAULT_POLICIES, make_policy
from balance_sim.router import make_router
from balance_sim.stepmodel import StepTimeModel
from balance_sim.workload import (
    Arrival,
    LengthDist,
    generate_arrivals,
    load_trace,
    rate_for_concurrency,
)


@dataclass(frozen=True)
class SimOptions:
    """Everything that decides the simulated numbers (wall-clock never does)."""

    dp_size: int = 8
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    num_requests: int = 2000
    concurrency: int | None = None  # default dp_size * max_num_seqs
    rate_per_s: float | None = None  # overrides concurrency
    arrivals: str = "poisson"
    burstiness: float = 0.25
    prompt_len: str = "uniform:128:1024"
    output_len: str = "longtail:128"
    trace: str | None = None
    router: str = "least-loaded"
    staleness: str = "stale+bump"
    snapshot_interval_ms: float = 100.0
    policies: tuple[str, ...] = DEFAULT_POLICIES
    seed: int = 0
    num_gpu_blocks: int | None = None  # default: enough that KV never preempts
    step_model: StepTimeModel = field(default_factory=StepTimeModel)

    @property
    def target_concurrency(self) -> int:
        return self.concurrency or self.dp_size * self.max_num_seqs


@dataclass
class Workload:
    arrivals: list[Arrival]
    rate_per_s: float | None


def estimated_step_s(options: SimOptions, mean_prompt: float, mean_output: float) -> float:
    """Model step time at the target concurrency, for the arrival rate (an estimate).

    In steady state the cluster admits ``concurrency / output_len`` requests per step; the
    lockstep step lasts as long as the rank with the most prefill, which is about one prompt
    per step once the cluster admits one or more per step (more when admissions outnumber
    ranks). Decode cost is every rank's share of the concurrency. The cluster-shared part
    (``shared_fraction``) is charged on all admissions' prefill and all decodes. The gather is
    left out: it depends on the policy, and every policy replays the same arrivals.
    """
    model, concurrency = options.step_model, options.target_concurrency
    admissions_per_step = concurrency / mean_output
    prompts_on_slowest_rank = max(
        min(1.0, admissions_per_step), admissions_per_step / options.dp_size
    )
    slowest = model.rank_time_ms(
        int(mean_prompt * prompts_on_slowest_rank), int(concurrency / options.dp_size)
    )
    shared = model.shared_time_ms(
        int(mean_prompt * admissions_per_step), int(concurrency), options.dp_size
    )
    return (slowest + shared) / 1000.0


def concurrency_for_rate(
    options: SimOptions, rate_per_s: float, mean_prompt: float, mean_output: float
) -> float:
    """The in-flight requests that ``rate_per_s`` sustains: ``rate_for_concurrency`` inverted.

    The rate grows monotonically with the concurrency (a larger batch lengthens the step by
    less than it adds requests), so bisection finds it. It levels off, though (the step grows
    with the batch): a rate above what any concurrency sustains is ``inf``.
    """

    def rate_at(concurrency: float) -> float:
        at = dataclasses.replace(options, concurrency=concurrency)
        step_s = estimated_step_s(at, mean_prompt, mean_output)
        return rate_for_concurrency(concurrency, mean_output, step_s)

    low, high = 0.0, float(options.dp_size * options.max_num_seqs)
    while rate_at(high) < rate_per_s:
        if high > 1e9:
            return float("inf")
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if rate_at(middle) < rate_per_s else (low, middle)
    return (low + high) / 2


def offered_load(options: SimOptions, workload: Workload) -> float:
    """Requests in flight the workload offers, as a multiple of ``dp x max_num_seqs``.

    1.0 is the rate that keeps every rank's running set at the cap by the model's estimate;
    docs/results.md's operating envelope is drawn on this axis.
    """
    slots = options.dp_size * options.max_num_seqs
    if not options.rate_per_s and not options.trace:
        return options.target_concurrency / slots
    arrivals = workload.arrivals
    mean_prompt = sum(a.prompt_len for a in arrivals) / len(arrivals)
    mean_output = sum(a.output_len for a in arrivals) / len(arrivals)
    if workload.rate_per_s:
        rate = workload.rate_per_s
    else:  # a trace: its mean rate
        span = arrivals[-1].time_s - arrivals[0].time_s
        rate = (len(arrivals) - 1) / span if span > 0 else float("inf")
    return concurrency_for_rate(options, rate, mean_prompt, mean_output) / slots


def build_workload(options: SimOptions) -> Workload:
    if options.trace:
        return Workload(load_trace(options.trace), None)
    prompt, output = LengthDist.parse(options.prompt_len), LengthDist.parse(options.output_len)
    rate = options.rate_per_s or rate_for_concurrency(
        options.target_concurrency, output.mean, estimated_step_s(options, prompt.mean, output.mean)
    )
    arrivals = generate_arrivals(
        options.num_requests,
        rate,
        prompt,
        output,
        options.seed,
        options.arrivals,
        options.burstiness,
    )
    return Workload(arrivals, rate)


def cluster_config(options: SimOptions, arrivals: Sequence[Arrival]):
    from balance_sim.builders import BLOCK_SIZE
    from balance_sim.engine import ClusterConfig

    longest = max(a.prompt_len + a.output_len for a in arrivals)
    max_model_len = -(-longest // BLOCK_SIZE) * BLOCK_SIZE
    blocks = options.num_gpu_blocks or options.max_num_seqs * (max_model_len // BLOCK_SIZE + 1) + 1
    return ClusterConfig(
        dp_size=options.dp_size,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_model_len=max(max_model_len, 16),
        num_gpu_blocks=blocks,
    )


def scenario_json(options: SimOptions, workload: Workload, import_vllm: bool = True) -> dict:
    scenario = dataclasses.asdict(options)
    if not options.step_model.gather_hop_us:
        # Absent when unset: sim.json of every scenario before the key existed stays identical.
        del scenario["step_model"]["gather_hop_us"]
    if options.step_model.gather_collective == "all_gather":
        del scenario["step_model"]["gather_collective"]  # likewise
    scenario["policies"] = list(options.policies)
    scenario["trace"] = Path(options.trace).name if options.trace else None
    scenario["target_concurrency"] = options.target_concurrency
    scenario["rate_per_s"] = round(workload.rate_per_s, 6) if workload.rate_per_s else None
    scenario["num_requests"] = len(workload.arrivals)
    if import_vllm:
        import vllm

        import vllm_balance

        scenario["vllm_version"] = vllm.__version__
        scenario["balance_path"] = vllm_balance.active_path()
    return scenario


@dataclass
class PolicyRun:
    record: Any  # engine.RunRecord; None where only the summary was asked for (sweeps)
    summary: Any  # metrics.Summary
    wall_s: float  # terminal only; kept out of the JSON
    cpu_s: float = 0.0  # this process's CPU time for the run (benchmarks: immune to other load)


def run_policy(
    options: SimOptions,
    spec: str,
    workload: Workload,
    on_step: Callable[[Any], None] | None = None,
) -> PolicyRun:
    from balance_sim.engine import Cluster
    from balance_sim.metrics import summarize

    router = make_router(
        options.router, options.dp_size, options.staleness, options.snapshot_interval_ms / 1000.0
    )
    cluster = Cluster(
        cluster_config(options, workload.arrivals),
        make_policy(spec),
        router,
        options.step_model,
        workload.arrivals,
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    cluster.run(on_step)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    record = cluster.record()
    return PolicyRun(record, summarize(record), wall, cpu)


def scenario_title(options: SimOptions, workload: Workload, seed: bool = True) -> str:
    """One line naming the scenario, for plot titles."""
    if options.trace:
        load = f"trace {Path(options.trace).name}"
    else:
        load = (
            f"{workload.rate_per_s:.1f} req/s {options.arrivals}, prompts {options.prompt_len}, "
            f"outputs {options.output_len}"
        )
    return (
        f"DP={options.dp_size}, max_num_seqs={options.max_num_seqs}, {load}, "
        f"shared_fraction={options.step_model.shared_fraction:g}"
        + (f", seed {options.seed}" if seed else "")
    )


def quiet_vllm_logs() -> None:
    """vLLM logs INFO lines on every config; the terminal is for the progress bar and table.

    What vLLM still logs goes to stderr (vLLM's default is stdout), so stdout carries only the
    simulator's table or advice and can be redirected to a file as it is.
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def show_balance_log_lines(interval_s: float) -> None:
    """Let the product's periodic per-rank log line through (wall-clock, not in the JSON)."""
    import logging

    from balance_sim.policies import Policy

    Policy.log_interval_s = interval_s
    # vLLM's handler filters at VLLM_LOGGING_LEVEL (quieted to WARNING above): give the
    # product's logger its own INFO handler in vLLM's line format instead.
    from vllm_balance.log import LOGGER_NAME

    logger = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("INFO %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
