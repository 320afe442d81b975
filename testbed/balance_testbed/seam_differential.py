"""Differential test driver: two Scheduler classes, one workload, the same outputs step by step.

The seam must not change behaviour (by default it holds nothing back, and the capacity flag it
guards is then never skipped), so the unpatched and the patched ``Scheduler`` of the same vLLM
are run on the same workload by ``lockstep`` (the engine the balance differential uses
too), which compares everything observable after every step: the ``SchedulerOutput``
(new/cached/resumed/preempted/finished requests, tokens per request, block ids), the request
outputs fed back by ``update_from_output`` (tokens, finish reasons), and the scheduler's queues,
per-request progress and free KV blocks. An exception of the candidate is an outcome too (a
wrong seam that trips ``schedule()``'s own ``assert len(self.running) <= max_num_running_reqs``
diverges, it does not crash the test); one of the unpatched baseline is a test error. Workloads
may throttle prefill as vLLM's DP engine core does (``Workload.prefill_interval``), which is what
reads the capacity flag.

The two classes come from balance_testbed/seam_patch.py: the installed module, and a copy of its
source with the series applied (or reverted, when the installed vLLM is the seamed one) loaded
under another module name. Used by tests/test_seam_neutrality.py (which ``nox -s reach --seam``
runs per release) and by ``benchmarks/run.py --parts seam``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from types import ModuleType

from balance_testbed import factories
from balance_testbed.lockstep import Side, Workload, lockstep, vllm_config
from balance_testbed.seam_patch import (
    SCHEDULER_MODULE,
    SEAM_METHOD,
    PatchError,
    installed_version,
    load_scheduler_module,
    match_series,
    scheduler_text,
)


@dataclass(frozen=True)
class Twins:
    """The installed scheduler module and its counterpart with the seam applied or reverted."""

    unpatched: type
    patched: type
    patched_source: str
    series_ref: str
    installed_is_patched: bool


@functools.lru_cache(maxsize=1)
def twins() -> Twins:
    import importlib
    import inspect

    installed: ModuleType = importlib.import_module(SCHEDULER_MODULE)
    source = inspect.getsource(installed)
    match = match_series(source, installed_version() or None)
    other = scheduler_text(source, match.series, reverse=match.already_seamed)
    if match.already_seamed:
        twin = load_scheduler_module(other, "vllm_balance_twin_unpatched_scheduler")
        unpatched, patched, patched_source = twin.Scheduler, installed.Scheduler, source
    else:
        twin = load_scheduler_module(other, "vllm_balance_twin_patched_scheduler")
        unpatched, patched, patched_source = installed.Scheduler, twin.Scheduler, other
    # Never compare a thing with itself: exactly one side has the seam, and it is real code.
    assert unpatched is not patched
    assert not hasattr(unpatched, SEAM_METHOD) and hasattr(patched, SEAM_METHOD)
    return Twins(unpatched, patched, patched_source, match.series.ref, match.already_seamed)


def mutant(patched_source: str, name: str) -> type:
    """A deliberately wrong seam series (negative control), built from the patched source.

    On the release's slot check, which the seam leaves inline right above its call:
    ``off_by_one_gt``, ``>`` where it has ``>=`` (or ``==``): admits one request past the slot
    limit; ``cap_minus_one``, the limit minus one (the variant that once shipped in vllm-ascend and
    was reverted for a TTFT regression): admits one request too few. Both are neutrality bugs (the
    default holds nothing back). On what a hold does, caught by the hold tests:
    ``held_not_capacity``, the policy the previous series put in core (a held step does not update
    ``prefill_capacity_bound``); ``kv_holders_held``, the call without its ``request_queue is
    self.waiting`` guard where the release drains KV-holders first (the previous series' place:
    a finished async KV load stays parked, holding its blocks).
    """
    lines = patched_source.split("\n")
    call = next(i for i, ln in enumerate(lines) if f"self.{SEAM_METHOD}()" in ln)
    # The call's `if` starts at the line after the slot check's `break`.
    start = next(i for i in range(call, 0, -1) if lines[i].lstrip().startswith("if "))
    slot, slot_break = start - 2, start - 1
    assert lines[slot_break].strip() == "break" and "self.max_num_" in lines[slot]
    end = next(i for i in range(call, len(lines)) if lines[i].strip() == "break")
    count = 1
    if name == "off_by_one_gt":
        lines[slot], count = re.subn(r">=|==", ">", lines[slot])
    elif name == "cap_minus_one":
        lines[slot], count = re.subn(r"(self\.max_num_\w+_reqs)", r"(\1 - 1)", lines[slot])
    elif name == "held_not_capacity":
        indent = lines[end][: len(lines[end]) - len(lines[end].lstrip())]
        lines.insert(end, f"{indent}self.mutant_held = True")
        update = next(
            i for i in range(end, len(lines)) if "self.prefill_capacity_bound =" in lines[i]
        )
        pad = lines[update][: len(lines[update]) - len(lines[update].lstrip())]
        lines[update : update + 1] = [f"{pad}if not self.mutant_held:", "    " + lines[update]]
        head = next(i for i, ln in enumerate(lines) if ln.startswith("    def schedule("))
        body = next(i for i in range(head, len(lines)) if lines[i].rstrip().endswith(":"))
        lines.insert(body + 1, "        self.mutant_held = False")
    elif name == "kv_holders_held":
        guarded = [i for i in range(start, call + 1) if "request_queue is self.waiting" in lines[i]]
        count = len(guarded)
        indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
        if count:
            lines[start : end + 1] = [f"{indent}if self.{SEAM_METHOD}():", f"{indent}    break"]
    else:
        raise ValueError(name)
    if count != 1:
        raise MutantNotApplicable(f"mutant {name}: no target in this release's seam")
    source = "\n".join(lines)
    return load_scheduler_module(source, f"vllm_balance_mutant_{name}_scheduler").Scheduler


class MutantNotApplicable(LookupError):
    """The mutant's target is not in this release's seam (``kv_holders_held`` before 0.31)."""


def compare(baseline_cls: type, candidate_cls: type, workload: Workload) -> int:
    """Raise Divergence at the first differing step; return the number of steps compared."""
    return lockstep(workload, [side(baseline_cls, workload), side(candidate_cls, workload)]).steps


def reached(scheduler_cls: type, workload: Workload) -> set[str]:
    """The paths ``workload`` reaches on ``scheduler_cls`` alone (a lockstep run of one side)."""
    return set(lockstep(workload, [side(scheduler_cls, workload)]).facts)


def side(scheduler_cls: type, workload: Workload) -> Side:
    scheduler = factories.make_scheduler(scheduler_cls, vllm_config=vllm_config(workload, False))
    return Side(scheduler_cls.__module__, scheduler)


@functools.lru_cache(maxsize=1)
def balance_on_each_path() -> dict[str, type]:
    """The balance ``Scheduler`` of each path for the installed vLLM, side by side in one process:
    ``"shim"`` on the seamed twin, ``"compat"`` derived from the unpatched one and
    ``"pause-state"`` on the unpatched one (what a session with the other pin's seam flag, or the
    other hold, would select), all with the package's own mixin. A path the release cannot have
    is left out: ``"shim"`` where no series serves it, ``"compat"`` where no copy derives
    (0.34+)."""
    import importlib
    import os
    import sys

    from vllm_balance.compat.derive import (
        ALLOW_UNVERIFIED_ENV,
        Phase2AUnavailable,
        build_phase2a_schedule,
    )
    from vllm_balance.compat.pause_state import PauseStateHold
    from vllm_balance.shim.scheduler import BalanceSchedulerMixin

    try:
        pair: Twins | None = twins()
    except PatchError:
        pair = None
    unpatched = pair.unpatched if pair else importlib.import_module(SCHEDULER_MODULE).Scheduler
    paths = {
        "pause-state": type(
            "PauseStateBalanceScheduler", (PauseStateHold, BalanceSchedulerMixin, unpatched), {}
        )
    }
    if pair is not None:
        paths["shim"] = type("BalanceScheduler", (BalanceSchedulerMixin, pair.patched), {})
    # For the comparison only: whether this release's schedule() is verified for the compat path
    # is test_compat_derive's question (and reach's, which may be verifying it in this run).
    allowed = os.environ.get(ALLOW_UNVERIFIED_ENV)
    os.environ[ALLOW_UNVERIFIED_ENV] = "1"
    try:
        derived = build_phase2a_schedule(sys.modules[unpatched.__module__])
        paths["compat"] = type("CompatBalanceScheduler", (BalanceSchedulerMixin, derived), {})
    except Phase2AUnavailable:
        pass
    finally:
        if allowed is None:
            del os.environ[ALLOW_UNVERIFIED_ENV]
        else:
            os.environ[ALLOW_UNVERIFIED_ENV] = allowed
    return paths
