"""Benchmarks of balance scheduling, reported as ratios measured within one run.

    python benchmarks/run.py                      # the default parts: schedule, gather, sim
    python benchmarks/run.py --parts schedule --reps 40
    nox -s bench -- --parts gather

Parts (what each measures, how, and its results: docs/results.md "Benchmarks"; the gather at
scale: docs/scaling.md):
(a) ``schedule``: ``schedule()`` of the product's balance class (gate open; gate frozen) vs
    upstream ``Scheduler`` at DP 8/64/256, admission- and decode-heavy steps; and the gate's own
    per-step cost (``BalanceGate.leader_at_cap()``), which is where balance-on time goes.
(b) ``gather``: ``balance_gather()`` on a real gloo group vs bare ``all_reduce``/``all_gather``,
    vs ``steps.unwatched_gather()`` (the watchdog's cost) and vs the log-depth collective.
(c) ``sim``: simulated lockstep steps per CPU second at DP 8/64/256; serial vs parallel wall time.
(d) ``instructions`` (not in the default set: ~15 min under valgrind): ``instructions.py``.
(e) ``seam`` (not in the default set): what the upstream seam itself costs (``bench_seam``).

Timings are never asserted anywhere; this prints ratios (and writes them as JSON with --json).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable
from pathlib import Path

import steps
import torch
import torch.distributed as dist

from balance_sim.markdown import markdown_table

ROOT = Path(__file__).resolve().parent.parent
DP_SIZES = (8, 64, 256)


def interleaved_timings(
    groups: dict[Hashable, dict[str, Callable[[], object]]], reps: int
) -> dict[tuple[Hashable, str], list[tuple[int, int]]]:
    """(wall ns, thread CPU ns) of one ``schedule()`` per group, variant and repetition.

    Each repetition prepares a fresh scheduler per variant (not timed) and times one
    ``schedule()``; within a group the variants run in rotating order, so drift and other load on
    the machine hit them alike (ratios of medians).
    """
    samples: dict[tuple[Hashable, str], list[tuple[int, int]]] = {}
    for rep in range(reps):
        for group, variants in groups.items():
            names = list(variants)
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                scheduler = variants[name]()
                samples.setdefault((group, name), []).append(_time_schedule(scheduler))
        print(f"  rep {rep + 1}/{reps}", file=sys.stderr, end="\r")
    return samples


# -- (a) schedule() ----------------------------------------------------------------------------
def _time_schedule(scheduler) -> tuple[int, int]:
    gc.collect()
    gc.disable()
    try:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        scheduler.schedule()
        return time.perf_counter_ns() - wall, time.thread_time_ns() - cpu
    finally:
        gc.enable()


def _median_ms(samples: list[tuple[int, int]], cpu: bool = False) -> float:
    return statistics.median(sample[cpu] for sample in samples) / 1e6


def bench_schedule(reps: int) -> dict:
    import vllm_balance

    configs = {dp: steps.scheduler_configs(dp) for dp in DP_SIZES}
    groups = {
        (dp, workload): {
            variant: functools.partial(steps.prepared_scheduler, variant, configs[dp], workload)
            for variant in steps.VARIANTS
        }
        for dp in DP_SIZES
        for workload in steps.WORKLOADS
    }
    times = interleaved_timings(groups, reps)
    rows = []
    for dp, workload in groups:
        ms = {variant: _median_ms(times[((dp, workload), variant)]) for variant in steps.VARIANTS}
        rows.append(
            {
                "dp": dp,
                "workload": workload,
                "upstream_ms": round(ms["upstream"], 4),
                "on_open_ratio": round(ms["on-open"] / ms["upstream"], 4),
                "on_frozen_ratio": round(ms["on-frozen"] / ms["upstream"], 4),
            }
        )
    return {
        "active_path": vllm_balance.active_path(),
        "reps": reps,
        "rows": rows,
        "gate_us": bench_gate(vllm_balance.BalanceScheduler, configs),
    }


def bench_gate(balance_cls, configs) -> dict:
    """Median cost of the once-per-step gate decision (``BalanceGate.leader_at_cap()``) alone,
    in µs."""
    from balance_testbed.factories import make_scheduler

    result = {}
    for dp in DP_SIZES:
        scheduler = make_scheduler(balance_cls, configs[dp][1])
        samples = []
        for _ in range(200):
            start = time.perf_counter_ns()
            scheduler.balance_gate.leader_at_cap()
            samples.append((time.perf_counter_ns() - start) / 1e3)
        result[dp] = round(statistics.median(samples), 2)
    return result


# -- (b) gather --------------------------------------------------------------------------------


def _gather_worker(rank: int, world: int, port: int, iters: int, results) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm_balance
    from balance_testbed.factories import (
        add_requests,
        make_requests,
        make_scheduler,
        make_vllm_config,
    )
    from balance_testbed.factories import step as engine_step
    from vllm_balance.shim import collective

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    group = dist.new_group(backend="gloo")  # like vLLM's stateless gloo dp_group

    def gathering_scheduler(collective_name: str):
        config = make_vllm_config(  # a cap above every rank's 4 + rank requests: DP up to 252
            data_parallel_size=world,
            max_num_seqs=steps.CAP,
            additional_config={
                "enable_balance_scheduling": True,
                "balance_collective": collective_name,
            },
        )
        scheduler = make_scheduler(vllm_balance.BalanceScheduler, config)
        add_requests(scheduler, make_requests(4 + rank, max_tokens=10_000))
        engine_step(scheduler)
        scheduler.follow_dp_group(group)
        return scheduler

    scheduler = gathering_scheduler("all_gather")
    reducing = gathering_scheduler("recursive_doubling")
    one = torch.ones(1, dtype=torch.int32)
    bare_out = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]
    ops = {
        "balance_gather": lambda: scheduler.balance_gather(),
        "unwatched_gather": lambda: steps.unwatched_gather(scheduler),
        "all_reduce": lambda: dist.all_reduce(one, group=group),
        "all_gather": lambda: dist.all_gather(bare_out, one, group=group),
    }
    ops["balance_reduce"] = lambda: reducing.balance_gather()
    ops["reduce_running"] = lambda: collective.reduce_running(4 + rank, group)
    # The same answer as the all_gather's max, min and sum.
    assert ops["reduce_running"]() == (4 + world - 1, 4, sum(4 + r for r in range(world)))
    names = list(ops)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(iters + 20):
        # A fresh order per iteration, the same on every rank (the collectives must match), so
        # that no op always runs right after the same other op (a rotation did that).
        order = list(names)
        random.Random(i).shuffle(order)
        for name in order:
            dist.barrier(group=group)  # start aligned: measure the collective, not the skew
            start = time.perf_counter_ns()
            ops[name]()
            elapsed = (time.perf_counter_ns() - start) / 1e3
            if i >= 20:  # warm-up excluded
                samples[name].append(elapsed)
    assert scheduler.balance_gate.stats.last_gathered == [4 + r for r in range(world)]
    assert reducing.balance_gate.leader == 4 + world - 1
    if rank == 0:
        # Median and quartiles: the spread within one run (repetitions give the spread between)
        results.put({name: statistics.quantiles(v, n=4) for name, v in samples.items()})
    dist.barrier(group=group)
    dist.destroy_process_group()


# Each ratio of a gather row: (numerator, denominator), of the ops' medians.
GATHER_RATIOS = {
    "gather_vs_all_reduce": ("balance_gather", "all_reduce"),
    "gather_vs_all_gather": ("balance_gather", "all_gather"),
    "watched_vs_unwatched": ("balance_gather", "unwatched_gather"),
    "reduce_vs_gather": ("balance_reduce", "balance_gather"),
}


def bench_gather(iters: int, dp_sizes: list[int]) -> list[dict]:
    import multiprocessing as mp

    from vllm.utils.network_utils import get_open_port

    ctx = mp.get_context("spawn")
    rows = []
    for world in dp_sizes:
        results = ctx.Queue()
        port = get_open_port()
        procs = [
            ctx.Process(target=_gather_worker, args=(r, world, port, iters, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        quartiles = results.get(timeout=1800)
        for p in procs:
            p.join(timeout=120)
        medians = {name: q[1] for name, q in quartiles.items()}
        rows.append(
            {"dp": world, "load_average": round(os.getloadavg()[0], 1)}
            | {f"{name}_us": round(median, 1) for name, median in medians.items()}
            | {key: round(medians[a] / medians[b], 3) for key, (a, b) in GATHER_RATIOS.items()}
            | {"quartiles_us": {n: [round(x, 1) for x in q] for n, q in sorted(quartiles.items())}}
        )
        print(f"  gather DP={world} done", file=sys.stderr)
    return rows


# -- (c) simulator throughput ------------------------------------------------------------------
SIM_REQUESTS_PER_RANK = 16  # the same work per rank at every DP: steps stay comparable
SIM_POLICIES = ("off", "on")


def bench_sim(dp_sizes: tuple[int, ...] = DP_SIZES) -> list[dict]:
    """Both policies at each DP, once in this process one after the other, once in parallel.

    The default scenario's load (dp x max_num_seqs in flight) with ``SIM_REQUESTS_PER_RANK``
    requests per rank. Per run: simulated steps, its own CPU seconds and steps per CPU second
    (what DP costs, independent of other load on the machine); per DP: the wall time of the
    serial and the parallel pass (what --jobs buys on this machine at this moment).
    """
    from balance_sim.parallel import Job, available_cores, run_jobs
    from balance_sim.runner import SimOptions

    processes = min(available_cores(), len(SIM_POLICIES))
    rows = []
    for dp in dp_sizes:
        options = SimOptions(dp_size=dp, num_requests=SIM_REQUESTS_PER_RANK * dp)
        jobs = [Job(options, policy, keep_record=False) for policy in SIM_POLICIES]
        walls = {}
        for label, count in (("serial", 1), ("parallel", processes)):
            start = time.perf_counter()
            runs = run_jobs(jobs, count)
            walls[label] = time.perf_counter() - start
        steps = sum(run.summary.steps for run in runs)
        cpu = sum(run.cpu_s for run in runs)
        rows.append(
            {
                "dp": dp,
                "requests": options.num_requests,
                "steps": steps,
                "cpu_s": round(cpu, 1),
                "steps_per_cpu_s": round(steps / cpu, 1),
                "rank_steps_per_cpu_s": round(steps * dp / cpu, 1),
                "serial_wall_s": round(walls["serial"], 1),
                "parallel_wall_s": round(walls["parallel"], 1),
                "processes": processes,
                "load_average": round(os.getloadavg()[0], 1),
            }
        )
        print(f"  sim DP={dp} done", file=sys.stderr)
    return rows


# -- (e) the upstream seam itself --------------------------------------------------------------
SEAM_WAITING = 1024
SEAM_PROMPT_LEN = 32


def bench_seam(reps: int) -> dict:
    """Upstream's ``Scheduler`` unpatched vs patched (``upstream_patch/``) on the step that calls
    the seam most: 1024 WAITING requests, ``max_num_seqs`` 256, so one ``schedule()`` admits 256
    requests and calls ``_should_stop_admitting_waiting`` 257 times.

    Three sides in the same rotation as (a): unpatched, patched, and an A/A control (the unpatched
    source loaded from a copy under another module name, as the patched one is), whose ratio is
    the noise floor; thread CPU time. Also the method call against the inline expression it
    replaced (``timeit``, best of 7, which load only ever slows down), times the 257 calls, over
    the step's median: an upper bound on the ratio that noise cannot blur.
    """
    import inspect
    import timeit

    from balance_testbed import seam_differential
    from balance_testbed.factories import (
        make_request,
        make_scheduler,
        make_vllm_config,
        request_specs,
    )
    from balance_testbed.seam_patch import SEAM_METHOD, load_scheduler_module, split_at_seam_method

    twins = seam_differential.twins()
    config = make_vllm_config(
        max_num_seqs=steps.CAP,
        max_num_batched_tokens=steps.CAP * SEAM_PROMPT_LEN,
        num_gpu_blocks=SEAM_WAITING * 4,
    )
    specs = request_specs(SEAM_WAITING, prompt_len=SEAM_PROMPT_LEN, max_tokens=16)

    def with_waiting(cls):
        def prepare():
            scheduler = make_scheduler(cls, vllm_config=config)
            for spec in specs:
                scheduler.add_request(make_request(spec))
            return scheduler

        return prepare

    unpatched_source = inspect.getsource(sys.modules[twins.unpatched.__module__])
    control = load_scheduler_module(unpatched_source, "vllm_balance_bench_aa_control").Scheduler
    classes = {"unpatched": twins.unpatched, "patched": twins.patched, "aa_control": control}
    groups = {"seam": {name: with_waiting(cls) for name, cls in classes.items()}}
    interleaved_timings(groups, 1)  # warm-up: imports, caches, first-call costs
    times = {name: samples for (_, name), samples in interleaved_timings(groups, reps).items()}

    # The seam call against its default body inline, in the state of the step's last check.
    scheduler = with_waiting(twins.patched)()
    assert len(scheduler.schedule().scheduled_new_reqs) == steps.CAP
    method = getattr(scheduler, SEAM_METHOD)
    body = split_at_seam_method(twins.patched_source)[1].split('"""')[-1]
    statements = [ln.strip() for ln in body.splitlines() if ln.strip()]
    # The default body as statements, with `return X` turned into an expression statement.
    inline = "\n".join(ln.removeprefix("return ") for ln in statements if not ln.startswith("#"))
    number = 20_000
    call_ns = min(timeit.repeat(method, number=number, repeat=7)) / number * 1e9
    inline_repeats = timeit.repeat(inline, globals={"self": scheduler}, number=number, repeat=7)
    inline_ns = min(inline_repeats) / number * 1e9
    step_ms = _median_ms(times["unpatched"], cpu=True)

    def ratio(name: str, cpu: bool) -> float:
        return round(_median_ms(times[name], cpu) / _median_ms(times["unpatched"], cpu), 4)

    return {
        "series": twins.series_ref,
        "waiting": SEAM_WAITING,
        "max_num_seqs": steps.CAP,
        "reps": reps,
        "median_cpu_ms": {name: round(_median_ms(t, cpu=True), 3) for name, t in times.items()},
        "cpu_ratio_patched": ratio("patched", cpu=True),
        "cpu_ratio_aa_control": ratio("aa_control", cpu=True),
        "wall_ratio_patched": ratio("patched", cpu=False),
        "wall_ratio_aa_control": ratio("aa_control", cpu=False),
        "seam_call_ns": round(call_ns),
        "inline_check_ns": round(inline_ns),
        "bound_ratio": round(
            1 + (steps.CAP + 1) * max(call_ns - inline_ns, 0.0) / (step_ms * 1e6), 4
        ),
    }


# -- report ------------------------------------------------------------------------------------
def markdown(results: dict) -> str:
    out = []
    if "schedule" in results:
        r = results["schedule"]
        out += [
            f"schedule() on the {r['active_path']} path, {r['reps']} interleaved repetitions, "
            "ratio of medians vs upstream `Scheduler`:",
            "",
        ]
        out += markdown_table(
            "DP | step | upstream ms | on, gate open | on, gate frozen",
            r["rows"],
            "{dp} | {workload} | {upstream_ms:.3f} | {on_open_ratio:.3f}x | {on_frozen_ratio:.3f}x",
        )
        gate = ", ".join(f"DP={dp}: {us} µs" for dp, us in r["gate_us"].items())
        out += ["", f"Gate decision `leader_at_cap()` alone (median): {gate}.", ""]
    if "gather" in results:
        out += markdown_table(
            "DP | balance_gather µs, all_gather | balance_gather µs, recursive_doubling "
            "| recursive_doubling / all_gather | bare reduce_running µs | without watchdog µs "
            "| bare all_reduce µs | bare all_gather µs | gather / without watchdog "
            "| gather / all_reduce | gather / all_gather | load average",
            results["gather"],
            "{dp} | {balance_gather_us} | {balance_reduce_us} | {reduce_vs_gather:.2f}x "
            "| {reduce_running_us} | {unwatched_gather_us} | {all_reduce_us} | {all_gather_us} "
            "| {watched_vs_unwatched:.3f}x | {gather_vs_all_reduce:.2f}x "
            "| {gather_vs_all_gather:.2f}x | {load_average}",
        )
        out.append("")
    if "sim" in results:
        out += [
            f"Policies {', '.join(SIM_POLICIES)}, {SIM_REQUESTS_PER_RANK} requests per rank; "
            "steps and CPU seconds summed over both runs:",
            "",
        ]
        out += markdown_table(
            "DP | requests | steps | CPU s | steps/CPU s | rank-steps/CPU s | wall, one process "
            "| wall, parallel | load average",
            results["sim"],
            "{dp} | {requests} | {steps} | {cpu_s} | {steps_per_cpu_s} | {rank_steps_per_cpu_s} "
            "| {serial_wall_s} s | {parallel_wall_s} s ({processes} processes) | {load_average}",
        )
    if "instructions" in results:
        import instructions

        out += ["", instructions.markdown(results["instructions"])]
    if "seam" in results:
        r = results["seam"]
        ms = r["median_cpu_ms"]
        out += [
            "",
            f"Seam ({r['series']}): schedule() admitting {r['max_num_seqs']} of {r['waiting']} "
            f"waiting, {r['reps']} rotating repetitions, median CPU ms: unpatched "
            f"{ms['unpatched']:.3f}, patched {ms['patched']:.3f}, A/A control "
            f"{ms['aa_control']:.3f}; ratio patched/unpatched {r['cpu_ratio_patched']:.4f} (A/A "
            f"{r['cpu_ratio_aa_control']:.4f}); wall ratio {r['wall_ratio_patched']:.4f} (A/A "
            f"{r['wall_ratio_aa_control']:.4f}); seam call {r['seam_call_ns']} ns vs inline "
            f"{r['inline_check_ns']} ns -> bound {r['bound_ratio']:.4f}",
        ]
    return "\n".join(out)


PARTS = ("schedule", "gather", "sim", "instructions", "seam")


def _parts(text: str) -> set[str]:
    parts = set(text.split(","))
    unknown = sorted(parts - set(PARTS))
    if unknown:  # a misspelt part would otherwise run nothing and print an empty report
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown}; choose from {PARTS}")
    return parts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--parts", type=_parts, default="schedule,gather,sim", help=f"comma-separated, of {PARTS}"
    )
    p.add_argument("--reps", type=int, default=30, help="schedule() repetitions per variant")
    p.add_argument("--gather-iters", type=int, default=500)
    p.add_argument(
        "--gather-dp",
        type=steps.int_list(2),  # a gather needs two ranks to cost anything
        default="2,4",
        help="comma-separated DP sizes (processes) of the gather part",
    )
    p.add_argument("--instruction-reps", type=int, default=3, help="callgrind measurements")
    p.add_argument("--seam-reps", type=int, default=41, help="seam repetitions per side")
    p.add_argument("--json", help="also write the results to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM's first import
    args = build_parser().parse_args(argv)
    parts = args.parts
    results: dict = {}
    if "schedule" in parts:
        results["schedule"] = bench_schedule(args.reps)
    if "gather" in parts:
        results["gather"] = bench_gather(args.gather_iters, args.gather_dp)
    if "sim" in parts:
        results["sim"] = bench_sim()
    if "instructions" in parts:
        import instructions  # benchmarks/ is on sys.path: this script's own folder

        results["instructions"] = instructions.measure(list(DP_SIZES), args.instruction_reps)
    if "seam" in parts:
        results["seam"] = bench_seam(args.seam_reps)
    results["command"] = "python benchmarks/run.py " + " ".join(argv or sys.argv[1:])
    steps.emit(results, markdown(results), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
