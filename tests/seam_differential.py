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

The two classes come from upstream_patch/seam_patch.py: the installed module, and a copy of its
source with the series applied (or reverted, when the installed vLLM is the seamed one) loaded
under another module name. Used by tests/test_seam_neutrality.py (which ``nox -s reach --seam``
runs per release) and by ``benchmarks/run.py --parts seam``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from types import ModuleType

import factories
from lockstep import Side, Workload, lockstep, vllm_config
from seam_patch import (
    SCHEDULER_MODULE,
    SEAM_METHOD,
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
    was reverted for a TTFT regression): admits one request too few. On the capacity exclusion:
    ``held_on_slot_break``, the hold's flag also set where the slot check stops admission, so a
    rank at its own cap no longer records capacity-bound for vLLM's prefill cadence.
    """
    lines = patched_source.split("\n")
    call = next(i for i, ln in enumerate(lines) if ln.strip() == f"if self.{SEAM_METHOD}():")
    slot, slot_break = call - 2, call - 1
    assert lines[slot_break].strip() == "break" and "self.max_num_" in lines[slot]
    count = 1
    if name == "off_by_one_gt":
        lines[slot], count = re.subn(r">=|==", ">", lines[slot])
    elif name == "cap_minus_one":
        lines[slot], count = re.subn(r"(self\.max_num_\w+_reqs)", r"(\1 - 1)", lines[slot])
    elif name == "held_on_slot_break":
        lines.insert(slot_break, lines[call + 1])  # the call's own `admission_held = True`
    else:
        raise ValueError(name)
    assert count == 1, f"mutant {name}: cannot find its target in {lines[slot]!r}"
    source = "\n".join(lines)
    return load_scheduler_module(source, f"vllm_balance_mutant_{name}_scheduler").Scheduler


def compare(baseline_cls: type, candidate_cls: type, workload: Workload) -> int:
    """Raise Divergence at the first differing step; return the number of steps compared."""
    return lockstep(workload, [side(baseline_cls, workload), side(candidate_cls, workload)]).steps


def reached(scheduler_cls: type, workload: Workload) -> set[str]:
    """The paths ``workload`` reaches on ``scheduler_cls`` alone (a lockstep run of one side)."""
    return set(lockstep(workload, [side(scheduler_cls, workload)]).facts)


def side(scheduler_cls: type, workload: Workload) -> Side:
    scheduler = factories.make_scheduler(scheduler_cls, vllm_config=vllm_config(workload, False))
    return Side(scheduler_cls.__module__, scheduler)
