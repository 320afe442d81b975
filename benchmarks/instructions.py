"""Instructions executed by one ``schedule()``, balance on vs upstream, counted by callgrind.

Also counted: the watchdog's cost on the engine's path, as one ``balance_gather()`` vs
``steps.unwatched_gather()`` (the same gather without the watchdog's lines). Both run with the
collective replaced by a Python no-op, so the two counts are exact and differ by the watchdog's
lines alone; a real ``balance_gather()`` on a one-rank gloo group is counted beside them as the
scale (its count moves by several percent from call to call: gloo's worker thread waits and wakes).

And the metrics' route, per step: ``make_stats()``, which vLLM calls once per step
with stats on, upstream vs a balance scheduler with nothing to carry (every step but one per
log interval) vs one that carries a publish (that one step, its ``publish()`` included); and on
the API server, the stat-logger plugin's ``record()`` of one engine's stats without and with
balance counters.

    python benchmarks/instructions.py                  # DP 8/64/256, 3 repetitions
    python benchmarks/instructions.py --metrics-only   # only the metrics' route
    python benchmarks/run.py --parts instructions      # the same, as a part of the benchmarks

Why instructions, not time (the ``<= 1.02x`` budget with the gate open is lost in wall-clock
noise; they are a deterministic function of the scheduler's state, ``PYTHONHASHSEED`` fixed,
one thread): see docs/results.md "``schedule()`` overhead in instructions".

How: a child process runs under ``valgrind --tool=callgrind`` with collection off, builds the
same prepared schedulers as ``run.py`` (fresh ones per measurement: ``schedule()`` mutates them)
and calls each measured ``schedule()`` through ``sys.call_tracing``. Its C function,
``_PyEval_CallTracing``, is the callgrind toggle: collection is on only inside it, and a dump is
written when it returns, so dump *k* holds exactly measured step *k*. The marker exists in every
CPython and vLLM never calls it; a ctypes callback (libffi closure) would not do, because
callgrind loses its call tracking there and stops counting early.

Needs ``valgrind`` on PATH and a CPython with symbols (pyenv, python.org, Debian builds have
them); a stripped interpreter shows up as all-zero dumps and is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import steps

from balance_sim.markdown import markdown_table

MARKER = "_PyEval_CallTracing"
GATHER_CALLS = 200
STATS_CALLS = 200


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3, help="counted rounds (default 3)")
    p.add_argument(
        "--dp", type=steps.int_list(1), default="8,64,256", help="comma-separated DP sizes"
    )
    p.add_argument(
        "--gather-only",
        action="store_true",
        help="count only balance_gather() with and without its watchdog (no schedule() steps)",
    )
    p.add_argument(
        "--metrics-only",
        action="store_true",
        help="count only the metrics' route: make_stats() and the stat logger's record()",
    )
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)  # labels file; set by the parent only
    return p


# -- child: runs under callgrind ----------------------------------------------------------------
def _measured(label: str, fn, labels: list[str] | None) -> None:
    """Run ``fn`` in a counted region (one callgrind dump); ``labels=None``: uncounted warm-up."""
    import gc

    if labels is None:
        fn()
        return
    gc.collect()
    gc.disable()  # a collection inside one variant's region only would skew that one count
    try:
        sys.call_tracing(fn, ())
    finally:
        gc.enable()
    labels.append(label)


def _no_collective(tensor_list, tensor, group=None, async_op=False) -> None:
    """``all_gather`` that does nothing, at a fixed cost: the gathers' own lines stay exact."""


def _repeated(gather, calls_per_region: int = GATHER_CALLS):
    """``calls_per_region`` calls in one counted region.

    Callgrind counts every thread while collection is on, and one gather is only ~40,000
    instructions: a single one read 38,000-48,000 from call to call (other threads running inside
    the window). Over many calls that noise is a rounding error.
    """

    def calls() -> None:
        for _ in range(calls_per_region):
            gather()

    return calls


def _metrics_regions() -> list[tuple[str, object]]:
    """The metrics' route, ``STATS_CALLS`` calls per region (labels ``stats/...``)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    import vllm_balance
    from balance_testbed.factories import make_scheduler
    from vllm_balance.shim.metrics import BalanceStatLogger

    plain_config, balance_config = steps.scheduler_configs(8)
    upstream = make_scheduler(Scheduler, plain_config, log_stats=True)
    idle = make_scheduler(vllm_balance.BalanceScheduler, balance_config, log_stats=True)
    carrying = make_scheduler(vllm_balance.BalanceScheduler, balance_config, log_stats=True)
    counted = carrying.balance_gate.stats
    counted.record_gather([4, 1, 0, 4, 2, 3, 4, 4])
    counted.record_step(frozen=True, released=False, num_waiting=7, dp_rank=0)

    def carry() -> None:  # the publishing step: the log line's publish, then the hand-over
        carrying.balance_gate.metrics.publish(counted)
        carrying.make_stats()

    logger = BalanceStatLogger(balance_config, list(range(8)))
    vllms = PrometheusStatLogger(plain_config, list(range(8)))  # the scale on the API server
    plain = upstream.make_stats()
    carrying.balance_gate.metrics.publish(counted)
    carried = carrying.make_stats()
    return [
        ("stats/upstream", _repeated(upstream.make_stats, STATS_CALLS)),
        ("stats/balance-idle", _repeated(idle.make_stats, STATS_CALLS)),
        ("stats/balance-publish", _repeated(carry, STATS_CALLS)),
        ("stats/record-plain", _repeated(lambda: logger.record(plain, None, 3), STATS_CALLS)),
        ("stats/record-balance", _repeated(lambda: logger.record(carried, None, 3), STATS_CALLS)),
        ("stats/record-vllm", _repeated(lambda: vllms.record(plain, None, None, 3), STATS_CALLS)),
    ]


def child(dp_sizes: list[int], reps: int, labels_file: str, metrics_only: bool) -> None:
    import torch.distributed as dist
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group
    from vllm.utils.network_utils import get_open_port

    import vllm_balance
    from balance_sim.builders import make_scheduler, make_vllm_config

    metrics = _metrics_regions()
    gatherer = None
    if not metrics_only:
        gatherer = make_scheduler(
            vllm_balance.BalanceScheduler,
            make_vllm_config(additional_config={"enable_balance_scheduling": True}),
        )
        gatherer.follow_dp_group(
            stateless_init_torch_distributed_process_group(
                "127.0.0.1", get_open_port(), 0, 1, backend="gloo"
            )
        )
    real_all_gather = dist.all_gather
    labels: list[str] = []
    # Round 0 is an uncounted warm-up: the first run of a code path pays one-time costs
    # (lazy imports, CPython's specializing interpreter, caches) that would land on whichever
    # variant happens to run first.
    for rep in range(reps + 1):
        sink = labels if rep else None
        for label, region in metrics:
            _measured(label, region, sink)
        if gatherer is None:
            continue
        for dp in dp_sizes:
            configs = steps.scheduler_configs(dp)
            for workload in steps.WORKLOADS:
                for variant in steps.VARIANTS:
                    sched = steps.prepared_scheduler(variant, configs, workload)
                    _measured(f"{dp}/{workload}/{variant}", sched.schedule, sink)
            gate = make_scheduler(vllm_balance.BalanceScheduler, configs[1])
            _measured(f"{dp}/gate/gate-only", gate.balance_gate.leader_at_cap, sink)
        # The first balance_gather() (round 0) starts the watchdog thread; it keeps running.
        _measured("gather/real", _repeated(gatherer.balance_gather), sink)
        dist.all_gather = _no_collective
        try:
            watched = ("gather/watched", _repeated(gatherer.balance_gather))
            unwatched = ("gather/unwatched", _repeated(lambda: steps.unwatched_gather(gatherer)))
            for label, gather in (watched, unwatched) if rep % 2 else (unwatched, watched):
                _measured(label, gather, sink)
        finally:
            dist.all_gather = real_all_gather
    payload = {"labels": labels, "active_path": vllm_balance.active_path()}
    Path(labels_file).write_text(json.dumps(payload))


# -- parent ------------------------------------------------------------------------------------
def _dump_totals(out_file: Path, count: int) -> list[int]:
    totals = []
    for k in range(1, count + 1):
        text = Path(f"{out_file}.{k}").read_text()
        totals.append(next(int(ln.split()[1]) for ln in text.splitlines() if ln[:7] == "totals:"))
    return totals


def measure(dp_sizes: list[int], reps: int, metrics_only: bool = False) -> dict:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("instructions: valgrind not found on PATH (apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="balance-callgrind-") as tmp:
        out_file = Path(tmp) / "callgrind.out"
        labels_file = Path(tmp) / "labels.json"
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        command = [
            valgrind,
            "--tool=callgrind",
            "--collect-atstart=no",
            f"--toggle-collect={MARKER}",
            f"--dump-after={MARKER}",
            f"--callgrind-out-file={out_file}",
            sys.executable,
            __file__,
            "--child",
            str(labels_file),
            "--reps",
            str(reps),
            *(["--dp", ",".join(map(str, dp_sizes))] if dp_sizes else ["--gather-only"]),
            *(["--metrics-only"] if metrics_only else []),
        ]
        print(
            "  instructions: running under callgrind (minutes: vLLM's import is ~50x slower)",
            file=sys.stderr,
        )
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = done.stderr[-3000:]
            raise SystemExit(f"instructions: child failed ({done.returncode}):\n{tail}")
        payload = json.loads(labels_file.read_text())
        totals = _dump_totals(out_file, len(payload["labels"]))
    if not any(totals):
        raise SystemExit(f"instructions: all dumps empty: {sys.executable} has no symbol {MARKER}")
    counts: dict[str, list[int]] = {}
    for label, total in zip(payload["labels"], totals):
        counts.setdefault(label, []).append(total)
    return {
        "active_path": payload["active_path"],
        "reps": reps,
        "rows": _rows(dp_sizes, counts),
        "gather": None if metrics_only else _gather_row(counts),
        "metrics": _metrics_row(counts),
        "counts": counts,
    }


def _gather_row(counts: dict[str, list[int]]) -> dict:
    """Per-gather medians (each count covers ``GATHER_CALLS`` gathers)."""
    per_call = {
        name: [total / GATHER_CALLS for total in counts[f"gather/{name}"]]
        for name in ("watched", "unwatched", "real")
    }
    watched, unwatched = per_call["watched"], per_call["unwatched"]
    real = statistics.median(per_call["real"])
    added = statistics.median(watched) - statistics.median(unwatched)
    return {
        "watched_instructions": round(statistics.median(watched)),
        "unwatched_instructions": round(statistics.median(unwatched)),
        "watchdog_instructions": round(added),
        "ratio": round(statistics.median(watched) / statistics.median(unwatched), 5),
        "spread": round(max(max(v) / min(v) - 1 for v in (watched, unwatched)), 5),
        "real_gather_instructions": round(real),
        "real_spread": round(max(per_call["real"]) / min(per_call["real"]) - 1, 5),
        # The real gather's count includes the watchdog's lines: with / without them.
        "watchdog_vs_real_gather": round(real / (real - added), 5),
    }


def _metrics_row(counts: dict[str, list[int]]) -> dict:
    """Per-call medians of the metrics' route (each count covers ``STATS_CALLS`` calls)."""
    per_call = {
        label.removeprefix("stats/"): statistics.median(total / STATS_CALLS for total in totals)
        for label, totals in counts.items()
        if label.startswith("stats/")
    }
    spread = max(
        max(totals) / min(totals) - 1 for label, totals in counts.items() if label[:6] == "stats/"
    )
    upstream = per_call["upstream"]
    return {
        "upstream_make_stats": round(upstream),
        "idle_step_added": round(per_call["balance-idle"] - upstream),
        "publish_step_added": round(per_call["balance-publish"] - upstream),
        "record_plain": round(per_call["record-plain"]),
        "record_balance": round(per_call["record-balance"]),
        "record_vllm": round(per_call["record-vllm"]),
        "spread": round(spread, 5),
    }


def _rows(dp_sizes: list[int], counts: dict[str, list[int]]) -> list[dict]:
    rows = []
    for dp in dp_sizes:
        gate = statistics.median(counts[f"{dp}/gate/gate-only"])
        for workload in steps.WORKLOADS:
            upstream = counts[f"{dp}/{workload}/upstream"]
            base = statistics.median(upstream)
            on_open = counts[f"{dp}/{workload}/on-open"]
            rows.append(
                {
                    "dp": dp,
                    "workload": workload,
                    "upstream_instructions": int(base),
                    "on_open_ratio": round(statistics.median(on_open) / base, 5),
                    "on_frozen_ratio": round(
                        statistics.median(counts[f"{dp}/{workload}/on-frozen"]) / base, 5
                    ),
                    "gate_instructions": int(gate),
                    # Rep-to-rep spread of the two counts the acceptance ratio divides.
                    "spread": round(max(max(v) / min(v) - 1 for v in (upstream, on_open)), 5),
                }
            )
    return rows


def markdown(result: dict) -> str:
    out = []
    if result["rows"]:
        out += [
            f"Instructions per `schedule()` on the {result['active_path']} path (callgrind, "
            f"{result['reps']} measurements each, medians), ratio vs upstream `Scheduler`:",
            "",
        ]
        out += markdown_table(
            "DP | step | upstream instructions | on, gate open | on, gate frozen "
            "| gate decision alone | rep-to-rep spread",
            result["rows"],
            "{dp} | {workload} | {upstream_instructions:,} | {on_open_ratio:.4f}x "
            "| {on_frozen_ratio:.4f}x | {gate_instructions:,} | {spread:.3%}",
        )
        out.append("")
    m = result["metrics"]
    out.append(
        f"The metrics' route on the {result['active_path']} path ({result['reps']} measurements "
        f"of {STATS_CALLS} calls each, medians per call, rep-to-rep spread {m['spread']:.3%}): "
        f"upstream's `make_stats()` executes {m['upstream_make_stats']:,} instructions; a "
        f"balance scheduler's adds {m['idle_step_added']:,} on a step with nothing to carry "
        f"and {m['publish_step_added']:,} on the step that carries a publish (once per log "
        f"interval, `publish()` included). On the API server the stat-logger plugin's "
        f"`record()` takes {m['record_plain']:,} per engine step without balance counters and "
        f"{m['record_balance']:,} with them (vLLM's own Prometheus logger's: "
        f"{m['record_vllm']:,})."
    )
    g = result["gather"]
    if g is None:
        return "\n".join(out)
    out += [
        "",
        f"The gather watchdog on the {result['active_path']} path ({result['reps']} measurements "
        f"of {GATHER_CALLS} gathers each, medians per gather): `balance_gather()` with the "
        f"collective stubbed out executes "
        f"{g['watched_instructions']:,} instructions, without the watchdog's lines "
        f"{g['unwatched_instructions']:,} ({g['ratio']:.4f}x, rep-to-rep spread "
        f"{g['spread']:.3%}): the watchdog adds {g['watchdog_instructions']:,} per gather. A real "
        f"`balance_gather()` on a one-rank gloo group executes {g['real_gather_instructions']:,} "
        f"(spread {g['real_spread']:.1%}); with the watchdog's lines it is "
        f"{g['watchdog_vs_real_gather']:.4f}x what it would be without them.",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM's first import
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps: expected a positive integer, got {args.reps}")
    dp_sizes = [] if args.gather_only or args.metrics_only else args.dp
    if args.child:
        child(dp_sizes, args.reps, args.child, args.metrics_only)
        return 0
    result = measure(dp_sizes, args.reps, args.metrics_only)
    steps.emit(result, markdown(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
