"""Differential engine for contract 2 and the gate: our BalanceScheduler against upstream's.

One generated :class:`Workload` is run on two real schedulers built from the same ``VllmConfig``:
upstream's ``Scheduler`` (the reference) and ``vllm_balance.BalanceScheduler`` (the class the
installed vLLM gets: shim on a seamed vLLM, compat otherwise). Both go through the same engine
steps in lockstep: add the requests that arrive, abort the requests due, make the grammars due
ready, ``schedule()``, fabricate the forward, ``update_from_output()`` and, where the mode says
so, ``balance_gather()`` (the engine core's position: after the step, before the next
``schedule()``). After every step the full ``describe(SchedulerOutput)``, the request outputs and
the queues (running order, the order of every waiting queue the release has, finished ids,
per-request progress, free KV blocks) must be equal; the first difference raises
:class:`Divergence` naming the step and the field path (``factories.observation_difference``).

Modes (what ``balance_queue`` holds and what the reference is):

- ``gate_open``: contract 2. ``balance_queue`` is set each step to a scripted vector whose largest
  entry is below the cap; the reference is plain upstream.
- ``oracle_queue``: the gate. ``balance_queue`` is set each step to a scripted vector that may hold
  the cap; the reference is :class:`GateOracle` (upstream, admission cut on frozen steps).
- ``oracle_gather``: the gate fed through the real ``balance_gather()``: the other ranks' counts
  are scripted, this rank's slot is whatever it sends (contract 3: payload ``len(running)``, one
  ``all_gather`` per step, on the injected group); the oracle computes the same vector from the
  reference's own ``len(running)``.
- ``disabled``: contract 4. Balance off, a DP group injected and ``balance_gather()`` called every
  step anyway, and ``balance_queue`` set each step to a scripted vector that may hold the cap (as a
  tool could set the public state): outputs equal upstream's, no ``all_gather`` ever, the
  constructor allocates no ``balance_queue`` and nothing replaces the one the harness set.

What is not generated, and why: remote-KV waits (``WAITING_FOR_REMOTE_KVS`` needs a KV connector
whose worker side reports finished transfers; none runs on CPU without writing one), LoRA
(``max_loras`` parking needs LoRA adapters), streaming-input sessions, spec decode, and async
scheduling (``test_compat_behaviour`` covers ``AsyncScheduler`` for the gate). Structured-output
waits are generated: the request really parks (in ``skipped_waiting`` up to 0.30, marked in
``deferred_waiting`` from 0.31) in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` until its grammar
``Future`` completes, which is vLLM's
own mechanism; the grammar itself is :class:`AcceptAllGrammar` (a real grammar backend needs a
tokenizer, and the scheduler only asks the grammar whether tokens are accepted).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import factories
import torch
from factories import SHARED_PREFIXES, Divergence, prompt_token_ids
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

import vllm_balance

MAX_STEPS = 150
ENABLED = {"enable_balance_scheduling": True}

# Default CI runs this on four sessions (two pins x seam/compat): keep each test to seconds.
# VLLM_BALANCE_DIFFERENTIAL_PROFILE=soak multiplies the examples for mutation and soak runs.
PROFILE = os.environ.get("VLLM_BALANCE_DIFFERENTIAL_PROFILE", "ci")
EXAMPLES_SCALE = {"ci": 1, "soak": 10}[PROFILE]


def property_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples * EXAMPLES_SCALE,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


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

    @property
    def request_id(self) -> str:
        return f"r{self.index}"

    def prompt(self) -> tuple[int, ...]:
        # Distinct tails per request: only the shared prefix can hit the prefix cache.
        return SHARED_PREFIXES[self.prefix] + prompt_token_ids(self.index, self.tail)

    def __repr__(self) -> str:
        grammar = "" if self.grammar_ready is None else f", grammar_ready={self.grammar_ready}"
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
    cap: int  # max_num_seqs == max_num_running_reqs
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    dp_size: int
    requests: tuple[Req, ...]
    aborts: tuple[tuple[int, int], ...]  # (before step, request index)
    gathered: tuple[Gathered, ...]  # per step, cycled

    def vector_shape(self, step_index: int) -> Gathered:
        return self.gathered[step_index % len(self.gathered)]

    def last_event(self) -> int:
        steps = [r.arrive for r in self.requests] + [s for s, _ in self.aborts]
        steps += [r.grammar_ready for r in self.requests if r.grammar_ready is not None]
        return max(steps, default=0)

    def __repr__(self) -> str:
        aborts = ", ".join(f"before step {s}: r{i}" for s, i in self.aborts)
        return (
            f"Workload(cap={self.cap}, max_num_batched_tokens={self.max_num_batched_tokens}, "
            f"long_prefill_token_threshold={self.long_prefill_token_threshold}, "
            f"num_gpu_blocks={self.num_gpu_blocks}, "
            f"prefix_caching={self.enable_prefix_caching}, dp_size={self.dp_size},\n"
            f"  requests=[{', '.join(map(repr, self.requests))}],\n"
            f"  aborts=[{aborts}],\n"
            f"  gathered per step (cycled)=[{', '.join(map(repr, self.gathered))}])"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # Hypothesis prints the falsifying example with its pretty printer: keep our repr.
        printer.text(repr(self))


DP_SIZES = st.sampled_from((2, 3, 4, 8, 64, 256))


@st.composite
def gathered_shapes(draw, cap: int, dp_size: int, at_cap: bool) -> Gathered:
    """A vector shape; ``at_cap=False`` keeps every rank below the cap (gate open)."""
    highest = cap if at_cap else cap - 1
    special = sorted({0, max(cap - 1, 0), highest} - {-1})
    top = draw(st.sampled_from(special) | st.integers(0, highest))
    n_top = draw(st.sampled_from((1, 2, dp_size)) | st.integers(1, dp_size))
    rest = draw(st.sampled_from((0, top)) | st.integers(0, top))
    return Gathered(top=top, n_top=n_top, rest=rest)


@st.composite
def workloads(draw, at_cap: bool, structured: bool = True) -> Workload:
    """Arrivals over time, lengths, shared prefixes, KV pressure, aborts, chunked prefill,
    long-prefill threshold, grammar waits, and one gathered-vector shape per step."""
    cap = draw(st.integers(1, 6))
    dp_size = draw(DP_SIZES)
    n = draw(st.integers(1, 9))
    arrivals = sorted(draw(st.lists(st.integers(0, 8), min_size=n, max_size=n)))
    requests = []
    for i, arrive in enumerate(arrivals):
        grammar_ready = None
        # One request in five waits for its grammar; the shrink target (0) is a plain request.
        if structured and draw(st.integers(0, 4)) == 4:
            grammar_ready = arrive + draw(st.integers(0, 6))
        requests.append(
            Req(
                index=i,
                prefix=draw(st.integers(0, len(SHARED_PREFIXES) - 1)),
                tail=draw(st.integers(1, 80)),
                max_tokens=draw(st.integers(1, 24)),
                arrive=arrive,
                grammar_ready=grammar_ready,
            )
        )
    shapes = draw(st.lists(gathered_shapes(cap, dp_size, at_cap), min_size=1, max_size=6))
    return Workload(
        cap=cap,
        # Small budgets force chunked prefill; 2048 admits whole prompts.
        max_num_batched_tokens=draw(st.sampled_from((2048, 16, 32, 64))),
        long_prefill_token_threshold=draw(st.sampled_from((0, 8, 24))),
        # The largest request needs 10 blocks (48 prefix + 80 tail + 24 output tokens); a few
        # such requests together overflow 14..40 blocks and get preempted.
        num_gpu_blocks=draw(st.sampled_from((1000, 14, 18)) | st.integers(14, 40)),
        enable_prefix_caching=draw(st.booleans()),
        dp_size=dp_size,
        requests=tuple(requests),
        aborts=tuple(
            draw(st.lists(st.tuples(st.integers(0, 20), st.integers(0, n - 1)), max_size=3))
        ),
        gathered=tuple(shapes),
    )


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
        additional_config=ENABLED if enabled else {},
    )


def vllm_config(workload: Workload, enabled: bool = True):
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


def make_request(req: Req):
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


def set_gathered(scheduler, counts: list[int]) -> None:
    scheduler.balance_queue = [torch.tensor([c], dtype=torch.int32) for c in counts]


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


# --------------------------------------------------------------------------------- the oracle


class GateOracle:
    """Upstream ``Scheduler`` whose WAITING admission is cut on frozen steps; none of our code.

    The contract puts the gate at the top of the WAITING loop: on a frozen step the loop body
    never runs, everything else of ``schedule()`` runs as upstream's. The oracle gets exactly
    that from upstream's own stop check: for the duration of a frozen ``schedule()`` it sets
    the admission limit (``max_num_running_reqs``; ``max_num_active_reqs`` from 0.31) to
    ``len(running)`` at entry, and restores it afterwards.

    Why this is faithful: in ``schedule()`` (0.24.0 ... 0.30.0) ``max_num_running_reqs`` is read
    only by the WAITING loop's stop check (``len(running) == cap``; 0.25's ``num_running >= cap``
    adds requests waiting for streaming input, which only makes it stop sooner) and by the final
    ``assert len(running) <= cap``. Between entry and the WAITING loop ``running`` only shrinks,
    by preemption, and a step that preempted skips the WAITING loop altogether. So on a frozen
    step the first stop check breaks before the first admission, exactly where the gate breaks,
    and nothing else of the step sees the change. The alternative, hiding the waiting queues
    during ``schedule()``, is not faithful: preemption prepends to ``self.waiting`` and 0.24's
    DP-prefill bookkeeping reads ``bool(self.waiting)`` after the loop.
    """

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    def schedule(self, frozen: bool):
        scheduler = self.scheduler
        if not frozen:
            return scheduler.schedule()
        # 0.31+ reads max_num_active_reqs only in that stop check (the assert reads the other).
        limit = admission_limit(scheduler)
        cap = getattr(scheduler, limit)
        setattr(scheduler, limit, len(scheduler.running))
        try:
            output = scheduler.schedule()
        finally:
            setattr(scheduler, limit, cap)
        # The construction's own check: a frozen step admits nothing from the waiting queues.
        assert not output.scheduled_new_reqs, "oracle admitted a new request on a frozen step"
        return output


# ---------------------------------------------------------------------- the other DP ranks


@dataclass
class OtherRanks:
    """``torch.distributed.all_gather`` as the other DP ranks answer it, for one rank under test.

    A stand-in only for the collective (up to 256 ranks cannot run on a CPU test machine): the
    scheduler, its ``balance_gather()`` and the tensors it gathers into are real. It records each
    call's payload and group, writes the payload into this rank's slot and the scripted counts
    into the others'.
    """

    group: object
    rank: int = 0
    others: list[int] = field(default_factory=list)
    calls: list[tuple[int, object]] = field(default_factory=list)

    def __call__(self, tensor_list, tensor, group=None, async_op=False):
        self.calls.append((int(tensor.item()), group))
        counts = list(self.others)
        counts.insert(self.rank, int(tensor.item()))
        assert len(tensor_list) == len(counts), "balance_queue is not one tensor per DP rank"
        for out, count in zip(tensor_list, counts):
            out.copy_(torch.tensor([count], dtype=out.dtype))


@contextlib.contextmanager
def collective(stand_in: OtherRanks) -> Iterator[OtherRanks]:
    import torch.distributed as dist

    real = dist.all_gather
    dist.all_gather = stand_in
    try:
        yield stand_in
    finally:
        dist.all_gather = real


class DPGroup:
    """The injected DP group (a real gloo group has only as many ranks as threads we run)."""

    def __repr__(self) -> str:
        return "<dp_group>"


# -------------------------------------------------------------------------------- the engine


def facts(scheduler, output, frozen: bool, vector_at_cap: bool) -> set[str]:
    """Which scheduler paths a step reached (to prove the generated workloads reach them).

    ``frozen`` is the reference's decision; ``vector_at_cap``: ``balance_queue`` held the cap.
    """
    found = set()
    if output.preempted_req_ids:
        found.add("preemption")
    # A preempted request scheduled again: a cached resumption, or (0.33 with the v2 model
    # runner, its default here) sent again as a new request.
    resumed_as_new = any(
        getattr(scheduler.requests.get(new.req_id), "num_preemptions", 0)
        for new in output.scheduled_new_reqs
    )
    if output.scheduled_cached_reqs.resumed_req_ids or resumed_as_new:
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
    cap = getattr(scheduler, admission_limit(scheduler))
    if len(scheduler.running) == cap and waiting:
        found.add("cap_reached_with_waiting")
    if frozen:
        found.add("frozen_step")
        if waiting and len(scheduler.running) < cap:
            found.add("frozen_with_room_and_waiting")
    elif output.scheduled_new_reqs:
        found.add("admitted")
        if vector_at_cap:  # balance off: a gate reading balance_queue would have frozen here
            found.add("admitted_with_cap_in_balance_queue")
    return found


@dataclass
class Run:
    """What a compared run reached, for the reachability assertions."""

    steps: int = 0
    facts: Counter = field(default_factory=Counter)


def _note(text: str) -> str:
    with contextlib.suppress(Exception):  # outside a hypothesis test there is nothing to note in
        note(text)
    return text


def _fail(workload: Workload, step_index: int, detail: str, vector: list[int] | None) -> None:
    """Raise Divergence; hypothesis prints the notes with the minimal (shrunk) example."""
    _note(f"minimal workload: {workload!r}")
    if vector is not None:
        shown = vector if len(vector) <= 16 else f"{vector[:8]} ... (max {max(vector)})"
        _note(f"step {step_index}: gathered vector {shown}, cap {workload.cap}")
    raise Divergence(f"step {step_index}: {detail}")


def compare(workload: Workload, mode: str) -> Run:
    """Run ``workload`` on BalanceScheduler and on the reference in lockstep; raise Divergence
    at the first step whose observation differs. Returns what the run reached."""
    from vllm.v1.request import RequestStatus

    enabled = mode != "disabled"
    ours = factories.make_scheduler(
        vllm_balance.BalanceScheduler, vllm_config=vllm_config(workload, enabled)
    )
    reference = factories.make_scheduler(vllm_config=vllm_config(workload, enabled))
    oracle = GateOracle(reference)
    group = DPGroup()
    stand_in = OtherRanks(group=group)
    gathers = mode in ("oracle_gather", "disabled")
    if gathers:
        ours.dp_group = group
    if mode == "disabled" and hasattr(ours, "balance_queue"):
        _fail(workload, 0, "balance off, yet BalanceScheduler allocated balance_queue", None)

    grammars: dict[str, list] = {}
    run = Run()
    last_event = workload.last_event()
    # Before the first gather, balance_queue is the constructor's zeros (nobody at the cap).
    vector: list[int] = [0] * workload.dp_size
    with collective(stand_in):
        for step_index in range(MAX_STEPS):
            for req in workload.requests:
                if req.arrive == step_index:
                    pair = [make_request(req), make_request(req)]
                    for scheduler, request in zip((ours, reference), pair):
                        scheduler.add_request(request)
                    if req.grammar_ready is not None:
                        grammars[req.request_id] = [
                            r.structured_output_request._grammar for r in pair
                        ]
                if req.grammar_ready == step_index and req.request_id in grammars:
                    for future in grammars.pop(req.request_id):
                        future.set_result(accept_all_grammar_cls()())
            for abort_step, index in workload.aborts:
                request_id = workload.requests[index].request_id
                if abort_step == step_index:
                    for scheduler in (ours, reference):
                        if request_id in scheduler.requests:
                            run.facts["abort"] += 1
                            scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
            idle = not (ours.has_unfinished_requests() or reference.has_unfinished_requests())
            if step_index > last_event and idle:
                break

            if mode in ("gate_open", "oracle_queue", "disabled"):
                vector = workload.vector_shape(step_index).counts(workload.dp_size)
                set_gathered(ours, vector)
                delivered = ours.balance_queue
            vector_at_cap = max(vector) == workload.cap
            frozen = enabled and vector_at_cap
            if mode == "gate_open":
                assert not frozen, "gate_open workloads keep every rank below the cap"

            try:
                our_output = ours.schedule()
                our_engine = ours.update_from_output(
                    our_output, factories.model_runner_output(our_output, ours)
                )
            except Exception as exc:  # an outcome: the reference did not raise (yet)
                _fail(workload, step_index, f"BalanceScheduler raised {exc!r}", vector)
            ref_output = oracle.schedule(frozen)
            ref_engine = reference.update_from_output(
                ref_output, factories.model_runner_output(ref_output, reference)
            )
            difference = factories.observation_difference(
                factories.observe(ours, our_output, our_engine),
                factories.observe(reference, ref_output, ref_engine),
            )
            if difference:
                _fail(workload, step_index, difference, vector)
            run.facts.update(facts(reference, ref_output, frozen, vector_at_cap))

            if gathers:
                calls_before = len(stand_in.calls)
                stand_in.others = workload.vector_shape(step_index).counts(workload.dp_size - 1)
                ours.balance_gather()
                calls = stand_in.calls[calls_before:]
            if mode == "disabled":
                if calls:
                    _fail(workload, step_index, f"balance off, yet all_gather {calls}", None)
                if getattr(ours, "balance_queue", None) is not delivered:
                    _fail(workload, step_index, "balance off, yet balance_queue was replaced", None)
            elif gathers:
                # Contract 3: one all_gather per engine step, payload len(running), our group.
                want = [(len(reference.running), group)]
                if calls != want:
                    detail = f"balance_gather() sent {calls}, expected {want} (len(running))"
                    _fail(workload, step_index, detail, vector)
                # The vector the next schedule() must act on, from the reference's own state.
                vector = list(stand_in.others)
                vector.insert(stand_in.rank, len(reference.running))
            run.steps += 1
    return run


def check_property(
    mode: str, *, at_cap: bool, max_examples: int, examples: tuple[Workload, ...] = ()
) -> Counter:
    """Run ``compare(workload, mode)`` on generated workloads (plus ``examples``, tried first);
    returns what the runs reached, so a test can assert its paths were exercised."""
    reached: Counter = Counter()

    def matches_reference(workload: Workload) -> None:
        reached.update(compare(workload, mode).facts)

    test = given(workload=workloads(at_cap=at_cap))(matches_reference)
    for workload in reversed(examples):
        test = example(workload=workload)(test)
    property_settings(max_examples=max_examples)(test)()
    return reached
