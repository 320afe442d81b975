"""What the benchmark scripts share: the measured scheduler steps, argument types and reports.

``run.py`` and ``instructions.py`` run from ``benchmarks/`` (their own folder is on ``sys.path``)
and import this module; neither imports the other's measuring code. ``serve_report.py`` imports
it as ``benchmarks.steps`` for its tables.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

CAP = 256
# The measured variants of one step: upstream's ``Scheduler``; the balance class, gate open/frozen.
VARIANTS = ("upstream", "on-open", "on-frozen")
WORKLOADS = ("admission", "decode")


def scheduler_configs(dp_size: int):
    from balance_testbed.factories import make_vllm_config

    common = dict(
        max_num_seqs=CAP,
        max_num_batched_tokens=CAP * 32,
        num_gpu_blocks=8192,
        data_parallel_size=dp_size,
    )
    return (
        make_vllm_config(**common),
        make_vllm_config(additional_config={"enable_balance_scheduling": True}, **common),
    )


def prepared_scheduler(variant: str, configs, workload: str):
    """``variant``'s scheduler on ``scheduler_configs(dp)``, one ``schedule()`` away from the
    measured step of ``workload``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    import vllm_balance
    from balance_testbed.factories import (
        add_requests,
        make_requests,
        make_scheduler,
        run_to_completion,
        step,
    )

    if variant == "upstream":
        scheduler = make_scheduler(Scheduler, configs[0])
    else:
        scheduler = make_scheduler(vllm_balance.BalanceScheduler, configs[1])
    # Warm-up: one request through a full life cycle, so first-call costs (lazy state in the
    # KV cache manager, code paths never run) are not charged to the measured step.
    add_requests(scheduler, make_requests(1, prompt_len=32, max_tokens=2, prefix="warm"))
    run_to_completion(scheduler)
    if workload == "admission":
        add_requests(scheduler, make_requests(1024, prompt_len=32, max_tokens=64))
    else:
        add_requests(scheduler, make_requests(CAP, prompt_len=32, max_tokens=64))
        step(scheduler)  # admit and prefill all 256; the measured step decodes them
    if variant == "on-frozen":
        gate = scheduler.balance_gate
        gate.set_gathered([0] * (gate.dp_size - 1) + [CAP])  # another rank is at the cap
    return scheduler


def unwatched_gather(scheduler) -> None:
    """``balance_gather()`` (default collective) without its watchdog lines: the baseline of the
    watchdog's cost.

    The watchdog thread (started by the scheduler's first ``balance_gather()``) is running while
    this is measured, as it is in serving; what differs is only the per-gather ``start_for``
    check and the timestamp the gather writes and clears. The gather-time accounting the metrics
    read stays in, so it is not charged to the watchdog.
    """
    gate = scheduler.balance_gate
    if gate is None:
        return
    running = len(scheduler.running)
    if running:  # balance_gather's pause check (the measured gatherers run nothing: not reached)
        from vllm_balance.shim.scheduler import PAUSED_ALL

        if PAUSED_ALL is not None and scheduler.pause_state == PAUSED_ALL:
            running = 0
    if gate.group is None:
        return
    started = time.monotonic()
    payload = torch.tensor([running], dtype=torch.int32)
    dist.all_gather(gate._buffer_views, payload, group=gate.group)
    gate.stats.gather_seconds += time.monotonic() - started
    gate.set_gathered(gate._buffer.tolist())


def emit(results: dict, report: str, json_path: str | None) -> None:
    """Print the report; with ``--json`` also write every number, with the vLLM version."""
    import vllm

    results["vllm_version"] = vllm.__version__
    print(report)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1) + "\n")


def int_list(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each at least ``minimum``."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
        return values

    return parse
