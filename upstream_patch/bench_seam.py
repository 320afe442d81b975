"""Overhead of the seam: patched vs unpatched ``schedule()`` on an admission-heavy step.

    python upstream_patch/bench_seam.py [--rounds 41] [--json FILE]

The step that calls the seam most: 1024 WAITING requests, ``max_num_seqs`` 256, so one
``schedule()`` admits 256 requests and calls ``_should_stop_admitting_waiting`` 257 times. Each
sample builds a fresh scheduler and queue (not timed) and times that one call, in CPU time of the
thread (wall time is reported too; on a shared machine it mostly measures the neighbours).

Three sides rotate through every round, so drift in machine load hits all of them: unpatched,
patched, and an A/A control, the unpatched source loaded from a copy under another module name as
the patched one is. The control's ratio is the noise floor: a patched ratio inside it means the
seam costs nothing measurable. The result is the ratio of medians, measured in this one run.

On a loaded machine that floor is wide, so the seam's own cost is also measured directly: the
method call against the inline expression it replaced (``timeit``, best of several repeats, which
load only ever slows down), times the 257 calls of the step, over the step's median time. That is
an upper bound on the ratio that noise cannot blur.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import differential  # noqa: E402
from seam_patch import load_scheduler_module  # noqa: E402

from vllm_balance import factories  # noqa: E402

WAITING = 1024
MAX_NUM_SEQS = 256
PROMPT_LEN = 32


def one_step_ns(scheduler_cls, vllm_config, specs) -> tuple[int, int]:
    scheduler = factories.make_scheduler(scheduler_cls, vllm_config=vllm_config)
    for spec in specs:
        scheduler.add_request(factories.make_request(spec))
    gc.collect()
    gc.disable()
    try:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        output = scheduler.schedule()
        cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
    finally:
        gc.enable()
    assert len(output.scheduled_new_reqs) == MAX_NUM_SEQS
    return cpu, wall


def seam_call_cost_ns(twins, vllm_config, specs) -> tuple[float, float]:
    """Per-call ns of the seam method and of its default body written inline (best of 7)."""
    scheduler = factories.make_scheduler(twins.patched, vllm_config=vllm_config)
    for spec in specs:
        scheduler.add_request(factories.make_request(spec))
    scheduler.schedule()  # MAX_NUM_SEQS running: the state at the step's last check
    method = getattr(scheduler, differential.SEAM_METHOD)
    body = inspect.getsource(method).split('"""')[-1]
    expression = [ln.strip() for ln in body.splitlines() if ln.strip()]
    # The default body as statements, with `return X` turned into an expression statement.
    inline = "\n".join(ln.removeprefix("return ") for ln in expression if not ln.startswith("#"))
    number = 20_000
    call = min(timeit.repeat(method, number=number, repeat=7)) / number * 1e9
    flat = (
        min(timeit.repeat(inline, globals={"self": scheduler}, number=number, repeat=7))
        / number
        * 1e9
    )
    return call, flat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    twins = differential.twins()
    vllm_config = factories.make_vllm_config(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_SEQS * PROMPT_LEN,
        num_gpu_blocks=WAITING * 4,
    )
    specs = factories.request_specs(WAITING, prompt_len=PROMPT_LEN, max_tokens=16)
    unpatched_source = inspect.getsource(sys.modules[twins.unpatched.__module__])
    control = load_scheduler_module(unpatched_source, "vllm_balance_bench_aa_control").Scheduler
    sides = {"unpatched": twins.unpatched, "patched": twins.patched, "aa_control": control}
    for cls in sides.values():  # warm-up: imports, caches, first-call costs
        one_step_ns(cls, vllm_config, specs)
    cpu: dict[str, list[int]] = {name: [] for name in sides}
    wall: dict[str, list[int]] = {name: [] for name in sides}
    names = list(sides)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            cpu_ns, wall_ns = one_step_ns(sides[name], vllm_config, specs)
            cpu[name].append(cpu_ns)
            wall[name].append(wall_ns)

    def ratio(samples: dict[str, list[int]], name: str) -> float:
        return statistics.median(samples[name]) / statistics.median(samples["unpatched"])

    call_ns, inline_ns = seam_call_cost_ns(twins, vllm_config, specs)
    step_ns = statistics.median(cpu["unpatched"])
    from importlib.metadata import version

    result = {
        "vllm": version("vllm"),
        "series": twins.series_ref,
        "waiting": WAITING,
        "max_num_seqs": MAX_NUM_SEQS,
        "rounds": args.rounds,
        "median_cpu_ms": {n: statistics.median(v) / 1e6 for n, v in cpu.items()},
        "median_wall_ms": {n: statistics.median(v) / 1e6 for n, v in wall.items()},
        "cpu_ratio_patched": ratio(cpu, "patched"),
        "cpu_ratio_aa_control": ratio(cpu, "aa_control"),
        "wall_ratio_patched": ratio(wall, "patched"),
        "wall_ratio_aa_control": ratio(wall, "aa_control"),
        "seam_call_ns": call_ns,
        "inline_check_ns": inline_ns,
        "bound_ratio": 1 + (MAX_NUM_SEQS + 1) * max(call_ns - inline_ns, 0.0) / step_ns,
    }
    ms = result["median_cpu_ms"]
    print(
        f"vLLM {result['vllm']}: schedule() admitting {MAX_NUM_SEQS} of {WAITING} waiting, "
        f"{args.rounds} rotating rounds, median CPU ms: unpatched {ms['unpatched']:.3f}, "
        f"patched {ms['patched']:.3f}, A/A control {ms['aa_control']:.3f}; "
        f"ratio patched/unpatched {result['cpu_ratio_patched']:.4f} "
        f"(A/A {result['cpu_ratio_aa_control']:.4f}); wall ratio "
        f"{result['wall_ratio_patched']:.4f} (A/A {result['wall_ratio_aa_control']:.4f}); "
        f"seam call {call_ns:.0f} ns vs inline {inline_ns:.0f} ns -> bound "
        f"{result['bound_ratio']:.4f}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
