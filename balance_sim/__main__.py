"""``vllm-balance-sim`` / ``python -m balance_sim``: compare DP admission policies.

Runs N DP ranks of the installed vLLM's real scheduler, replays one workload under each policy
(one process per core), prints a table and writes ``sim.json`` and PNG plots to ``--out``.
``vllm-balance-sim advise ...`` recommends whether to enable balance for a deployment;
``vllm-balance-sim envelope ...`` sweeps load x shared_fraction. See docs/sim.md.

Every bad input ends the program with one line on stderr, ``vllm-balance-sim: error: ...``,
and exit status 2, before any simulation starts; nothing a user types reaches them as a
traceback, and neither does a run on a Python without torch or vLLM (:func:`missing_runtime`).
``advise`` exits with its category's status (:mod:`balance_sim.advise`).
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from balance_sim.advise import CATEGORIES as ADVISE_CATEGORIES
from balance_sim.policies import DEFAULT_POLICIES, make_policy
from balance_sim.router import ROUTERS, STALENESS_MODES
from balance_sim.runner import SimOptions, quiet_vllm_logs, show_balance_log_lines
from balance_sim.stepmodel import (
    StepModelError,
    StepTimeModel,
    load_step_model,
    step_model_keys,
)
from balance_sim.workload import LengthDist, WorkloadError

DEFAULTS = SimOptions()
PROG = "vllm-balance-sim"


ERROR_PREFIX = f"{PROG}: error: "  # every error of every command starts with it


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the full usage is 40 lines: ``--help``), and
    every command's starts with :data:`ERROR_PREFIX` (a command's names it in the hint)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{ERROR_PREFIX}{message} (see {self.prog} --help)\n")


class CommandParser(OneLineErrorParser):
    """The run options, or a command's parser when the first argument names one.

    Not argparse sub-commands: with those, a mistyped option such as ``--dps 8`` is reported
    as "invalid choice: '8'" (its value taken for a command) instead of the option itself.
    """

    commands: dict[str, argparse.ArgumentParser]

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        if args and args[0] in self.commands:
            parsed, extras = self.commands[args[0]].parse_known_args(args[1:], namespace)
            parsed.command = args[0]
            return parsed, extras
        parsed, extras = super().parse_known_args(args, namespace)
        parsed.command = None
        return parsed, extras


# -- argument types: each rejects a bad value with a message argparse prints on one line ------
def _number(cast: Callable[[str], float], minimum: float, text: str, what: str):
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not value >= minimum or value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return int(_number(int, 1, text, "an integer >= 1"))


def non_negative_int(text: str) -> int:
    return int(_number(int, 0, text, "an integer >= 0"))


def positive_float(text: str) -> float:
    value = _number(float, 0, text, "a number > 0")
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    return _number(float, 0, text, "a number >= 0")


def _list_of(item: Callable[[str], float]) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return tuple(item(part) for part in parts)

    return parse


def fraction(text: str) -> float:
    value = _number(float, 0, text, "a number between 0 and 1")
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def length_dist(text: str) -> str:
    try:
        LengthDist.parse(text)
    except WorkloadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def policy_list(text: str) -> tuple[str, ...]:
    specs = tuple(part.strip() for part in text.split(",") if part.strip())
    if not specs:
        raise argparse.ArgumentTypeError(f"expected comma-separated policies, got {text!r}")
    for spec in specs:
        try:
            make_policy(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return specs


POLICY_HELP = (
    "comma-separated: off, on, cap-1, vllm-cadence[:N], trtllm-adp[:T[:W]], bounded-hold:K "
    "(docs/sim.md, Policies)"
)


# -- options ----------------------------------------------------------------------------------
def add_scenario_options(p: argparse.ArgumentParser) -> None:
    """The deployment and its workload: shared by run, advise and envelope."""
    add = p.add_argument
    add(
        "--dp",
        type=positive_int,
        default=DEFAULTS.dp_size,
        help="data-parallel ranks (%(default)s)",
    )
    add(
        "--max-num-seqs",
        type=positive_int,
        default=DEFAULTS.max_num_seqs,
        help="per-rank running cap, vLLM's max_num_seqs (%(default)s)",
    )
    add(
        "--max-num-batched-tokens",
        type=positive_int,
        default=DEFAULTS.max_num_batched_tokens,
        help="per-rank token budget of one step (%(default)s)",
    )
    add(
        "--num-requests",
        type=positive_int,
        default=DEFAULTS.num_requests,
        help="requests generated per run, ignored with --trace (%(default)s)",
    )
    add(
        "--concurrency",
        type=positive_int,
        help="target requests in flight; the arrival rate follows from it (default: dp x "
        "max-num-seqs)",
    )
    add("--rate", type=positive_float, help="arrivals per second; overrides --concurrency")
    add(
        "--arrivals",
        choices=("poisson", "bursty"),
        default=DEFAULTS.arrivals,
        help="arrival process (%(default)s)",
    )
    add(
        "--burstiness",
        type=positive_float,
        default=DEFAULTS.burstiness,
        help="gamma shape of --arrivals bursty; 1 = Poisson, lower = burstier (%(default)s)",
    )
    add(
        "--prompt-len",
        type=length_dist,
        default=DEFAULTS.prompt_len,
        help="prompt tokens: fixed:N | uniform:LO:HI | longtail:MEAN[:SIGMA] (%(default)s)",
    )
    add(
        "--output-len",
        type=length_dist,
        default=DEFAULTS.output_len,
        help="output tokens, same forms as --prompt-len (%(default)s)",
    )
    add(
        "--trace",
        help="JSONL, one request per line: arrival_time (s), prompt_len, output_len; replaces "
        "the generated workload",
    )
    add(
        "--router",
        choices=ROUTERS,
        default=DEFAULTS.router,
        help="how requests pick a rank: vLLM's DP load balancer up to 0.26 (least-loaded) or "
        "from 0.27 (inflight-floor), or round-robin (%(default)s)",
    )
    add(
        "--staleness",
        choices=STALENESS_MODES,
        default=DEFAULTS.staleness,
        help="what least-loaded sees: live counts, the snapshot, or the snapshot plus the "
        "client's bump (%(default)s); inflight-floor ignores it",
    )
    add(
        "--snapshot-interval-ms",
        type=non_negative_float,
        default=DEFAULTS.snapshot_interval_ms,
        help="how often the router's load snapshot refreshes (%(default)s)",
    )
    add(
        "--num-gpu-blocks",
        type=positive_int,
        help="KV blocks per rank (default: enough that nothing is preempted)",
    )
    add(
        "--step-model",
        help="JSON/TOML file overriding step-time model keys, e.g. shared_fraction, gather_ms, "
        "gather_hop_us (docs/sim.md, docs/scaling.md)",
    )
    add(
        "--jobs",
        type=positive_int,
        help="parallel processes, one policy run each (default: one per available core)",
    )
    add("--no-progress", action="store_true", help="no progress bar on stderr")


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog=PROG,
        usage=f"{PROG} [options]\n       {PROG} advise [options]\n       {PROG} envelope [options]",
        description="DP balance scheduling simulator on the installed vLLM's real scheduler. "
        "Without a command: run the policies on one scenario and write sim.json and plots.",
        epilog=f"Commands: '{PROG} advise [options]' recommends whether to enable balance for "
        f"your deployment; '{PROG} envelope [options]' sweeps load x shared_fraction. Each has "
        "--help. Docs: docs/sim.md.",
    )
    add_scenario_options(p)
    add = p.add_argument
    add(
        "--policies",
        type=policy_list,
        default=DEFAULT_POLICIES,
        help=f"{POLICY_HELP} (default: {','.join(DEFAULT_POLICIES)})",
    )
    add("--seed", type=non_negative_int, default=DEFAULTS.seed, help="workload seed (%(default)s)")
    add("--out", default="out/sim", help="directory for sim.json and the PNGs (%(default)s)")
    add(
        "--balance-log-interval-s",
        type=non_negative_float,
        default=0.0,
        help="print the product's per-rank 'Balance DPn' log line every N wall seconds "
        "(0 = never, the default)",
    )
    add("--no-plots", action="store_true", help="write sim.json only")

    advise = OneLineErrorParser(
        prog=f"{PROG} advise",
        description="Simulate off, on and the bounded hold over several seeds on your scenario, "
        "and off and on again with gather_ms and shared_fraction moved over their uncertain "
        "range; recommend whether to enable balance scheduling, with the predicted change, its "
        "spread and what the answer rests on; say when the scenario is outside what the "
        "simulator can judge.",
        epilog="Exit status: "
        + ", ".join(f"{c.status} {c.word}" for c in ADVISE_CATEGORIES)
        + ", 2 error (docs/sim.md, advise).",
    )
    add_scenario_options(advise)
    advise.add_argument(
        "--seeds",
        type=_list_of(non_negative_int),
        default=(0, 1, 2),
        help="workload seeds, at least 2 (default: 0,1,2)",
    )
    advise.add_argument(
        "--hold-steps",
        type=positive_int,
        default=8,
        help="the bounded hold to try, balance_max_frozen_steps (%(default)s)",
    )
    envelope = OneLineErrorParser(
        prog=f"{PROG} envelope",
        description="Run every policy and off at each load (a multiple of dp x max-num-seqs in "
        "flight) and shared_fraction over several seeds; write envelope.json, envelope.md and "
        "envelope.png to --out.",
    )
    add_scenario_options(envelope)
    envelope.add_argument(
        "--loads",
        type=_list_of(positive_float),
        default=(0.6, 0.8, 1.0, 1.2, 1.4, 1.6),
        help="concurrency as a multiple of dp x max-num-seqs (default: 0.6,0.8,1.0,1.2,1.4,1.6)",
    )
    envelope.add_argument(
        "--shared-fractions",
        type=_list_of(fraction),
        default=(0.0, 0.25, 0.5, 0.75, 1.0),
        help="step-model shared_fraction values (default: 0,0.25,0.5,0.75,1)",
    )
    envelope.add_argument(
        "--policies",
        type=policy_list,
        default=("on", "cap-1", "bounded-hold:8", "vllm-cadence:2"),
        help=POLICY_HELP + "; each is compared with off (default: on,cap-1,bounded-hold:8,"
        "vllm-cadence:2)",
    )
    envelope.add_argument(
        "--seeds", type=_list_of(non_negative_int), default=(0, 1, 2), help="default: 0,1,2"
    )
    envelope.add_argument("--out", default="out/envelope", help="output directory (%(default)s)")
    p.commands = {"advise": advise, "envelope": envelope}
    return p


def options_from_args(args: argparse.Namespace, policies=(), seed: int = 0) -> SimOptions:
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
        policies=tuple(policies),
        seed=seed,
        num_gpu_blocks=args.num_gpu_blocks,
        step_model=args.step_model or StepTimeModel(),
    )


def simulate(
    options: SimOptions,
    out_dir: Path,
    plots: bool = True,
    progress: bool = True,
    jobs: int = 1,
    log_interval_s: float = 0.0,
):
    """Run every policy on one workload; write sim.json (+ PNGs). Returns the PolicyRuns."""
    from balance_sim.parallel import Job, cached_workload, run_jobs
    from balance_sim.report import format_table, write_json, write_plots
    from balance_sim.runner import scenario_json, scenario_title

    for spec in options.policies:
        make_policy(spec)  # reject a bad spec before minutes of simulation
    workload = cached_workload(options)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = run_jobs(
        [Job(options, spec) for spec in options.policies], jobs, progress, log_interval_s
    )
    pairs = [(run.record, run.summary) for run in runs]
    write_json(out_dir / "sim.json", scenario_json(options, workload), pairs)
    if plots:
        write_plots(out_dir, pairs, scenario_title(options, workload))
    print(format_table([run.summary for run in runs]))
    return runs


def _run(args: argparse.Namespace, jobs: int) -> int:
    options = options_from_args(args, args.policies, args.seed)
    start = time.perf_counter()
    runs = simulate(
        options,
        Path(args.out),
        not args.no_plots,
        not args.no_progress,
        jobs,
        args.balance_log_interval_s,
    )
    steps = sum(run.summary.steps for run in runs)
    sim_cpu = sum(run.wall_s for run in runs)
    wall = time.perf_counter() - start
    processes = min(jobs, len(runs))
    print(
        f"\n{steps} simulated steps (DP={options.dp_size}, {len(runs)} policies, {processes} "
        f"process{'es' if processes > 1 else ''}): the runs took {sim_cpu:.1f} s "
        f"({steps / sim_cpu:.0f} steps/s each), {wall:.1f} s wall in all. Wrote "
        f"{Path(args.out) / 'sim.json'}" + ("" if args.no_plots else " and PNGs")
    )
    return 0


# What a run imports that the standard library lacks: import name -> the name a user installs.
RUNTIME = {"numpy": "numpy", "torch": "torch", "vllm": "vLLM"}


def missing_runtime(argv: list[str]) -> str | None:
    """The one line for an interpreter without numpy, torch or vLLM, else None.

    ``--help`` and a bad option need neither (the lint session checks ``--help`` without vLLM);
    a run does, and without this check it ends in a traceback about ``torch``, which says
    nothing about where the simulator can run.
    """
    missing = [shown for name, shown in RUNTIME.items() if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    named = " or ".join([", ".join(missing[:-1]), missing[-1]] if missing[:-1] else missing)
    nox_sim = shlex.join(["python3", "-m", "nox", "-s", "sim", *(["--", *argv] if argv else [])])
    return (
        f"{ERROR_PREFIX}no {named} in this Python ({sys.executable}): the "
        f"simulator drives vLLM's real scheduler; run `{nox_sim}`, which installs the pinned vLLM "
        "and CPU torch into .nox/sim (nox itself: `python3 -m pip install -r requirements/ci.txt`)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "advise" and len(args.seeds) < 2:
        parser.error("advise --seeds: at least 2 seeds, to state a spread")
    # Files are checked here, not by argparse types, so that parsing stays a pure syntax check
    # (a parser that reads no file can be built and tried without the files existing).
    if args.trace and not Path(args.trace).is_file():
        parser.error(f"argument --trace: no such file: {args.trace!r}")
    try:
        given_keys = step_model_keys(args.step_model) if args.step_model else frozenset()
        args.step_model = load_step_model(args.step_model) if args.step_model else None
    except StepModelError as exc:
        parser.error(f"argument --step-model: {exc}")
    if args.command == "envelope" and (args.trace or args.rate or args.concurrency):
        parser.error("envelope sets the load itself (--loads): drop --trace, --rate, --concurrency")
    missing = missing_runtime(sys.argv[1:] if argv is None else argv)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    quiet_vllm_logs()
    if getattr(args, "balance_log_interval_s", 0.0):
        show_balance_log_lines(args.balance_log_interval_s)
    from balance_sim.parallel import available_cores

    jobs = args.jobs or available_cores()
    try:
        if args.command == "advise":
            from balance_sim.advise import advise

            return advise(args, options_from_args(args), jobs, given_keys)
        if args.command == "envelope":
            from balance_sim.envelope import envelope

            return envelope(args, options_from_args(args), jobs)
        return _run(args, jobs)
    except (WorkloadError, StepModelError, ValueError) as exc:
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
