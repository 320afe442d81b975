"""The differential engine: real schedulers stepped in lockstep on one workload, compared per step.

Both differentials use it: ``balance_differential`` (BalanceScheduler against upstream's
``Scheduler`` or the gate oracle) and ``seam_differential`` (the unpatched against the seamed
``Scheduler``, or a mutant). One :class:`Workload` is run on every :class:`Side` through the same
engine steps: add the requests that arrive, make the grammars due ready, abort the requests due,
``schedule()``, fabricate the forward, ``update_from_output()``. After every step each side's
``factories.observe`` (the full ``SchedulerOutput``, the request outputs, the queues, per-request
progress, free KV blocks) must equal the first side's (the reference); the first difference, an
exception on a non-reference side, or a side's own check failing raises :class:`Divergence`
naming the step and the field path. An exception on the reference side is a test error, not an
outcome: upstream raising means the workload or the harness is wrong.

A side adds what its run does around the common step (:class:`Side`'s hooks): the balance
differential sets or gathers the gate's counts before ``schedule()``, freezes the oracle's
admission, and checks the gather after the step; the seam differential adds nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from hypothesis import note

from balance_testbed import factories
from balance_testbed.factories import SHARED_PREFIXES, Divergence, prompt_token_ids

MAX_STEPS = 200

# ------------------------------------------------------------------------------------ workloads


@dataclass(frozen=True)
class Req:
    """One request of a workload; its tokens are derived, so the repr stays short."""

    index: int
    prefix: int  # index into SHARED_PREFIXES
    tail: int  # prompt tokens after the prefix
    max_tokens: int
    arrive: int  # added before this step
    grammar_ready: int | None = None  # structured output: grammar Future completes before step
    # Remote KV (a scheduler with tests/async_kv_connector.py): its async load finishes this many
    # steps after it starts; the connector knows such a request by its "kv-" id.
    kv_load_steps: int | None = None

    @property
    def request_id(self) -> str:
        return f"r{self.index}" if self.kv_load_steps is None else f"kv-r{self.index}"

    def prompt(self) -> tuple[int, ...]:
        # Distinct tails per request: only the shared prefix can hit the prefix cache.
        return SHARED_PREFIXES[self.prefix] + prompt_token_ids(self.index, self.tail)

    def __repr__(self) -> str:
        grammar = "" if self.grammar_ready is None else f", grammar_ready={self.grammar_ready}"
        if self.kv_load_steps is not None:
            grammar += f", kv_load_steps={self.kv_load_steps}"
        return (
            f"{self.request_id}(prefix={self.prefix}, tail={self.tail}, "
            f"max_tokens={self.max_tokens}, arrive={self.arrive}{grammar})"
        )


@dataclass(frozen=True)
class Gathered:
    """The running counts the DP ranks report for one step, as a readable shape.

    ``n_top`` ranks report ``top``, every other rank reports ``rest`` (``rest <= top``). In the
    ``oracle_gather`` mode the shape covers the *other* ranks; this rank reports its own count.
    """

    top: int
    n_top: int
    rest: int

    def counts(self, ranks: int) -> list[int]:
        n_top = min(self.n_top, ranks)
        return [self.top] * n_top + [self.rest] * (ranks - n_top)

    def __repr__(self) -> str:
        return f"{self.n_top}x{self.top}+rest {self.rest}"


@dataclass(frozen=True)
class Workload:
    """A scheduler configuration and what happens to it, independent of any scheduler class.

    ``dp_size`` and ``gathered`` matter only to the balance differential (the seam one runs one
    rank and gathers nothing). ``prefill_interval`` is vLLM's DP prefill cadence as its DP engine
    core drives it (``prefill_schedule_interval``, #44558): ``schedule(throttle_prefills=True)``
    on every step whose index is not a multiple of it; 1, the default, never throttles.
    """

    cap: int  # max_num_seqs == max_num_running_reqs
    max_num_batched_tokens: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    requests: tuple[Req, ...]
    aborts: tuple[tuple[int, int], ...] = ()  # (before step, request index)
    long_prefill_token_threshold: int = 0
    dp_size: int = 1
    gathered: tuple[Gathered, ...] = ()  # per step, cycled
    prefill_interval: int = 1

    def throttled(self, step_index: int) -> bool:
        """As ``DPEngineCoreProc._should_throttle_prefills`` decides for its step counter."""
        return self.prefill_interval > 1 and step_index % self.prefill_interval != 0

    def vector(self, step_index: int, ranks: int) -> list[int]:
        """The scripted counts of ``ranks`` ranks for one step."""
        return self.gathered[step_index % len(self.gathered)].counts(ranks)

    def last_event(self) -> int:
        steps = [r.arrive for r in self.requests] + [s for s, _ in self.aborts]
        steps += [r.grammar_ready for r in self.requests if r.grammar_ready is not None]
        return max(steps, default=0)

    def __repr__(self) -> str:
        aborts = ", ".join(f"before step {s}: r{i}" for s, i in self.aborts)
        gathered = ""
        if self.gathered:
            gathered = f",\n  gathered per step (cycled)=[{', '.join(map(repr, self.gathered))}]"
        return (
            f"Workload(cap={self.cap}, max_num_batched_tokens={self.max_num_batched_tokens}, "
            f"long_prefill_token_threshold={self.long_prefill_token_threshold}, "
            f"num_gpu_blocks={self.num_gpu_blocks}, "
            f"prefix_caching={self.enable_prefix_caching}, dp_size={self.dp_size}, "
            f"prefill_interval={self.prefill_interval},\n"
            f"  requests=[{', '.join(map(repr, self.requests))}],\n"
            f"  aborts=[{aborts}]{gathered})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # Hypothesis prints the falsifying example with its pretty printer: keep our repr.
        printer.text(repr(self))


# ------------------------------------------------------------------------------ real objects


@functools.lru_cache(maxsize=128)
def _vllm_config(workload_config: tuple, enabled: bool):
    # VllmConfig construction is the slow part and schedulers do not mutate it: share it.
    cap, batched, threshold, blocks, caching, dp_size = workload_config
    return factories.make_vllm_config(
        max_num_seqs=cap,
        max_num_batched_tokens=batched,
        long_prefill_token_threshold=threshold,
        num_gpu_blocks=blocks,
        enable_prefix_caching=caching,
        data_parallel_size=dp_size,
        additional_config={"enable_balance_scheduling": True} if enabled else {},
    )


def vllm_config(workload: Workload, enabled: bool):
    key = (
        workload.cap,
        workload.max_num_batched_tokens,
        workload.long_prefill_token_threshold,
        workload.num_gpu_blocks,
        workload.enable_prefix_caching,
        workload.dp_size,
    )
    return _vllm_config(key, enabled)


@functools.cache
def accept_all_grammar_cls() -> type:
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

    class AcceptAllGrammar(StructuredOutputGrammar):
        """A compiled grammar that accepts every token (a real backend needs a tokenizer)."""

        def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
            return True

        def validate_tokens(self, tokens: list[int]) -> list[int]:
            return tokens

        def rollback(self, num_tokens: int) -> None:
            pass

        def fill_bitmask(self, bitmask: Any, batch_index: int) -> None:
            pass

        def is_terminated(self) -> bool:
            return False

        def reset(self) -> None:
            pass

    return AcceptAllGrammar


def new_request(req: Req):
    """A real Request; a structured-output one waits on a grammar Future, as vLLM's do."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.request import Request

    structured = None
    if req.grammar_ready is not None:
        structured = StructuredOutputsParams(regex="[a-z]+")
    params = SamplingParams(
        max_tokens=req.max_tokens, ignore_eos=True, structured_outputs=structured
    )
    request = Request(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt()),
        sampling_params=params,
        pooling_params=None,
        arrival_time=float(req.index),
        block_hasher=factories.block_hasher(),
    )
    if structured is not None:
        request.structured_output_request.grammar = Future()
    return request


def admission_limit(scheduler) -> str:
    """The attribute upstream's WAITING loop stops at: ``max_num_active_reqs`` where it exists."""
    return (
        "max_num_active_reqs"
        if hasattr(scheduler, "max_num_active_reqs")
        else "max_num_running_reqs"
    )


def has_deferred_waiting(scheduler) -> bool:
    """A waiting request was skipped (structured-output grammar not ready, ...)."""
    deferred = getattr(scheduler, "deferred_waiting", None)  # 0.31+
    return bool(deferred if deferred is not None else scheduler.skipped_waiting)


def step_facts(scheduler, output) -> set[str]:
    """Which scheduler paths a step reached (to prove the workloads reach what a claim covers)."""
    found = set()
    if output.preempted_req_ids:
        found.add("preemption")
    # A preempted request scheduled again: a cached resumption, or (0.33 with the v2 model
    # runner, its default here) sent again as a new request.
    resumed_as_new = any(
        getattr(scheduler.requests.get(new.req_id), "num_preemptions", 0)
        for new in output.scheduled_new_reqs
    )
    if getattr(output.scheduled_cached_reqs, "resumed_req_ids", ()) or resumed_as_new:
        found.add("resumption")
    if any(new.num_computed_tokens > 0 for new in output.scheduled_new_reqs):
        found.add("prefix_cache_hit")
    # Requests that finished in this step are already gone from ``requests``.
    scheduled = (scheduler.requests.get(rid) for rid in output.num_scheduled_tokens)
    if any(r is not None and r.is_prefill_chunk for r in scheduled):
        found.add("chunked_prefill")
    if has_deferred_waiting(scheduler):
        found.add("skipped_waiting")
    waiting = scheduler.get_request_counts()[1] > 0
    if waiting and len(scheduler.running) == getattr(scheduler, admission_limit(scheduler)):
        found.add("cap_reached_with_waiting")
    if scheduler.prefill_capacity_bound:
        found.add("prefill_capacity_bound")
    return found


# -------------------------------------------------------------------------------- the engine


class Side:
    """One scheduler of a lockstep run. A subclass adds what its run does around the step."""

    def __init__(self, name: str, scheduler) -> None:
        self.name = name
        self.scheduler = scheduler

    def before_schedule(self, step_index: int) -> None:
        """After the step's arrivals and aborts, before ``schedule()``."""

    def schedule(self, throttle_prefills: bool):
        return self.scheduler.schedule(throttle_prefills)

    def after_step(self, step_index: int) -> str | None:
        """After ``update_from_output()`` and the comparison: what is wrong, or None."""
        return None

    def facts(self, output) -> set[str]:
        """Facts of the step beyond ``step_facts`` (asked of the reference side only)."""
        return set()

    def context(self) -> str | None:
        """A line for the failure report (e.g. the gathered vector this step acted on)."""
        return None

    def step(self, throttle_prefills: bool = False) -> tuple[Any, dict]:
        output = self.schedule(throttle_prefills)
        engine_outputs = self.scheduler.update_from_output(
            output, factories.model_runner_output(output, self.scheduler)
        )
        return output, factories.observe(self.scheduler, output, engine_outputs)


@dataclass
class Run:
    """What a lockstep run reached, for the reachability assertions."""

    steps: int = 0
    facts: Counter = field(default_factory=Counter)


def _note(text: str) -> None:
    with contextlib.suppress(Exception):  # outside a hypothesis test there is nothing to note in
        note(text)


def diverged(workload: Workload, step_index: int, detail: str, sides: Sequence[Side] = ()):
    """Raise Divergence; hypothesis prints the notes with the minimal (shrunk) example."""
    _note(f"minimal workload: {workload!r}")
    for side in sides:
        context = side.context()
        if context:
            _note(f"step {step_index}: {context}")
    raise Divergence(f"step {step_index}: {detail}")


def _arrive_and_abort(workload: Workload, step_index: int, sides, grammars: dict, run: Run):
    from vllm.v1.request import RequestStatus

    for req in workload.requests:
        if req.arrive == step_index:
            requests = [new_request(req) for _ in sides]
            for side, request in zip(sides, requests):
                side.scheduler.add_request(request)
            if req.grammar_ready is not None:
                grammars[req.request_id] = [r.structured_output_request._grammar for r in requests]
        if req.grammar_ready == step_index and req.request_id in grammars:
            for future in grammars.pop(req.request_id):
                future.set_result(accept_all_grammar_cls()())
    for abort_step, index in workload.aborts:
        request_id = workload.requests[index].request_id
        if abort_step == step_index:
            for side in sides:
                if request_id in side.scheduler.requests:
                    run.facts["abort"] += 1
                    side.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)


def lockstep(workload: Workload, sides: Sequence[Side]) -> Run:
    """Step ``sides`` through ``workload`` together, the first side the reference; raise
    Divergence at the first step another side differs from it. Returns what the run reached."""
    reference, *others = sides
    grammars: dict[str, list] = {}
    run = Run()
    last_event = workload.last_event()
    for step_index in range(MAX_STEPS):
        _arrive_and_abort(workload, step_index, sides, grammars, run)
        idle = not any(side.scheduler.has_unfinished_requests() for side in sides)
        if step_index > last_event and idle:
            break
        for side in sides:
            side.before_schedule(step_index)
        throttle = workload.throttled(step_index)
        output, expected = reference.step(throttle)
        for side in others:
            try:
                observed = side.step(throttle)[1]
            except Exception as exc:  # an outcome: the reference did not raise
                diverged(workload, step_index, f"{side.name} raised {exc!r}", sides)
            difference = factories.observation_difference(observed, expected)
            if difference:
                diverged(workload, step_index, difference, sides)
        run.facts.update(step_facts(reference.scheduler, output) | reference.facts(output))
        if throttle and reference.scheduler.get_request_counts()[1]:
            run.facts["throttled_with_waiting"] += 1
        for side in sides:
            problem = side.after_step(step_index)
            if problem:
                diverged(workload, step_index, problem, sides)
        run.steps += 1
    return run
