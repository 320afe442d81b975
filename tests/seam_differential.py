"""Differential test driver: two Scheduler classes, one workload, the same outputs step by step.

The seam must not change behaviour, so the unpatched and the patched ``Scheduler`` of the same
vLLM are run on the same workload and everything observable is compared after every step
(``factories.observe``, the observation the balance differential makes too): the
``SchedulerOutput`` (new/cached/resumed/preempted/finished requests, tokens per request, block
ids), the request outputs fed back by ``update_from_output`` (tokens, finish reasons), and the
scheduler's queues, per-request progress and free KV blocks. An exception on one side is an
outcome too: it is compared like any other (a wrong seam that trips ``schedule()``'s own
``assert len(self.running) <= max_num_running_reqs`` diverges, it does not crash the test).

The two classes come from upstream_patch/seam_patch.py: the installed module, and a copy of its
source with the series applied (or reverted, when the installed vLLM is the seamed one) loaded
under another module name. Used by tests/test_seam_neutrality.py (which ``nox -s reach --seam``
runs per release) and by ``benchmarks/run.py --parts seam``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import factories
from factories import Divergence
from seam_patch import (
    SCHEDULER_MODULE,
    SEAM_METHOD,
    installed_version,
    load_scheduler_module,
    match_series,
    scheduler_text,
    split_at_seam_method,
)


@dataclass(frozen=True)
class Workload:
    """A scheduler configuration and what happens to it, independent of any scheduler class."""

    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    requests: tuple[factories.RequestSpec, ...]
    arrival_steps: tuple[int, ...]  # engine step before which each request is added
    aborts: tuple[tuple[int, int], ...] = ()  # (step, request index): abort before that step
    max_steps: int = 200


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
    """A deliberately wrong seam (negative control), built from the patched source.

    ``off_by_one_gt``: ``>`` where the default has ``>=`` (or ``==``): admits one request past
    the slot limit. ``cap_minus_one``: the limit minus one, the variant that once shipped in
    vllm-ascend and was reverted for a TTFT regression: admits one request too few.
    """
    head, method, tail = split_at_seam_method(patched_source)
    lines = method.split("\n")
    at = max(i for i, ln in enumerate(lines) if ln.strip().startswith("return "))
    if name == "off_by_one_gt":
        wrong, count = re.subn(r">=|==", ">", lines[at])
    elif name == "cap_minus_one":
        wrong, count = re.subn(r"(self\.max_num_\w+_reqs)", r"(\1 - 1)", lines[at])
    else:
        raise ValueError(name)
    assert count == 1, f"mutant {name}: cannot find its target in {lines[at]!r}"
    lines[at] = wrong
    source = head + "\n".join(lines) + tail
    return load_scheduler_module(source, f"vllm_balance_mutant_{name}_scheduler").Scheduler


@functools.lru_cache(maxsize=64)
def _vllm_config(max_num_seqs: int, max_num_batched_tokens: int, blocks: int, caching: bool):
    # VllmConfig creation is the slow part; the scheduler does not mutate it, so share it.
    return factories.make_vllm_config(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_gpu_blocks=blocks,
        enable_prefix_caching=caching,
    )


def _facts(scheduler, output, workload: Workload, preempted_before: set[str]) -> set[str]:
    """Which scheduler paths this step exercised (to show the workloads reach what the
    neutrality claim covers; compared like everything else)."""
    found = set()
    if output.preempted_req_ids:
        found.add("preemption")
    # A preempted request scheduled again: through resumed_req_ids up to 0.32, re-sent as a new
    # request from 0.33. Either way it is the resumption path.
    if preempted_before & set(output.num_scheduled_tokens):
        found.add("resumption")
    if any(new.num_computed_tokens > 0 for new in output.scheduled_new_reqs):
        found.add("prefix_cache_hit")
    if any(scheduler.requests[rid].is_prefill_chunk for rid in output.num_scheduled_tokens):
        found.add("chunked_prefill")
    if len(scheduler.running) >= workload.max_num_seqs and scheduler.waiting:
        found.add("max_num_seqs_hit")
    return found


def facts_of(records: Sequence[dict]) -> set[str]:
    found = set()
    for record in records:
        found |= set(record.get("facts", ()))
        if "raised" in record:
            found.add("raised")
    return found


def trace(scheduler_cls: type, workload: Workload) -> list:
    """Every observable of every step, ending with the exception if the scheduler raised."""
    from vllm.v1.request import RequestStatus

    scheduler = factories.make_scheduler(
        scheduler_cls,
        vllm_config=_vllm_config(
            workload.max_num_seqs,
            workload.max_num_batched_tokens,
            workload.num_gpu_blocks,
            workload.enable_prefix_caching,
        ),
    )
    records: list = []
    last_arrival = max(workload.arrival_steps, default=0)
    preempted: set[str] = set()
    try:
        for step_index in range(workload.max_steps):
            for spec, arrival in zip(workload.requests, workload.arrival_steps):
                if arrival == step_index:
                    scheduler.add_request(factories.make_request(spec))
            facts = set()
            for abort_step, index in workload.aborts:
                request_id = workload.requests[index].request_id
                if abort_step == step_index and request_id in scheduler.requests:
                    scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
                    facts.add("abort")
            if step_index > last_arrival and not scheduler.has_unfinished_requests():
                break
            output = scheduler.schedule()
            facts |= _facts(scheduler, output, workload, preempted)
            preempted |= set(output.preempted_req_ids or ())
            runner_output = factories.model_runner_output(output, scheduler)
            engine_outputs = scheduler.update_from_output(output, runner_output)
            records.append(
                {
                    "step": step_index,
                    **factories.observe(scheduler, output, engine_outputs),
                    "facts": sorted(facts),
                }
            )
    except Exception as exc:  # an outcome to compare, not a test error
        records.append({"step": len(records), "raised": f"{type(exc).__name__}: {exc}"})
    return records


def compare(baseline_cls: type, candidate_cls: type, workload: Workload) -> int:
    """Raise Divergence at the first differing step; return the number of steps compared."""
    expected = trace(baseline_cls, workload)
    actual = trace(candidate_cls, workload)
    for want, got in zip(expected, actual):
        difference = factories.first_difference(got, want)
        if difference:
            raise Divergence(f"step {want.get('step')}: {difference:.600}")
    if len(expected) != len(actual):
        raise Divergence(f"trace lengths differ: {len(expected)} vs {len(actual)} steps")
    return len(expected)
