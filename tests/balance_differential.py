"""Differential for contract 2 and the gate: our BalanceScheduler against upstream's.

One generated :class:`Workload` is run by ``lockstep`` (the engine both differentials share) on
two real schedulers built from the same ``VllmConfig``: upstream's ``Scheduler`` (the reference,
:class:`GateOracle`) and ``vllm_balance.BalanceScheduler`` (:class:`Ours`: the class the installed
vLLM gets, shim on a seamed vLLM, compat otherwise). What this module adds to the common engine
step: the gathered counts set before ``schedule()`` (``balance_gate.set_gathered()``) or, where
the mode says so, ``balance_gather()``
called after the step (the engine core's position: after the step, before the next
``schedule()``) and checked; the reference's admission frozen where the vector holds the cap.
The first difference raises :class:`Divergence` naming the step and the field path.

Modes (what the gate reads and what the reference is):

- ``gate_open``: contract 2. The counts are set each step to a scripted vector whose largest
  entry is below the cap; the reference is plain upstream.
- ``oracle_queue``: the gate. The counts are set each step to a scripted vector that may hold
  the cap; the reference is :class:`GateOracle` (upstream, admission cut on frozen steps).
- ``oracle_gather``: the gate fed through the real ``balance_gather()``: the other ranks' counts
  are scripted, this rank's slot is whatever it sends (contract 3: payload ``len(running)``, one
  ``all_gather`` per step, on the injected group); the oracle computes the same vector from the
  reference's own ``len(running)``.
- ``disabled``: contract 4. Balance off, a DP group handed over and ``balance_gather()`` called
  every step anyway, while the reference's scripted vector may hold the cap: outputs equal
  upstream's, no ``all_gather`` ever, and the constructor builds no ``balance_gate``.

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
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import vllm_balance
from balance_testbed import factories
from balance_testbed.factories import SHARED_PREFIXES
from balance_testbed.lockstep import (
    Gathered,
    Req,
    Run,
    Side,
    Workload,
    admission_limit,
    diverged,
    lockstep,
    vllm_config,
)

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
        assert len(tensor_list) == len(counts), "the gather's buffer is not one per DP rank"
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


@dataclass(frozen=True)
class DPGroup:
    """The injected DP group (a real gloo group has only as many ranks as threads we run): its
    size and this rank's place in it, which the gather sizes its buffer by."""

    dp_size: int
    dp_rank: int = 0

    def size(self) -> int:
        return self.dp_size

    def rank(self) -> int:
        return self.dp_rank

    def __repr__(self) -> str:
        return "<dp_group>"


# ------------------------------------------------------------------------------------ the sides


class Ours(Side):
    """BalanceScheduler: its counts set before each ``schedule()`` or gathered after it."""

    def __init__(self, workload: Workload, mode: str, stand_in: OtherRanks) -> None:
        super().__init__(
            "BalanceScheduler",
            factories.make_scheduler(
                vllm_balance.BalanceScheduler,
                vllm_config=vllm_config(workload, enabled=mode != "disabled"),
            ),
        )
        self.workload, self.mode, self.stand_in = workload, mode, stand_in
        if mode in ("oracle_gather", "disabled"):
            self.scheduler.follow_dp_group(stand_in.group)

    def before_schedule(self, step_index: int) -> None:
        if self.mode not in ("oracle_gather", "disabled"):
            vector = self.workload.vector(step_index, self.workload.dp_size)
            self.scheduler.balance_gate.set_gathered(vector)

    def after_step(self, step_index: int) -> str | None:
        if self.mode not in ("oracle_gather", "disabled"):
            return None
        calls_before = len(self.stand_in.calls)
        self.stand_in.others = self.workload.vector(step_index, self.workload.dp_size - 1)
        self.scheduler.balance_gather()
        calls = self.stand_in.calls[calls_before:]
        if self.mode == "disabled":
            if calls:
                return f"balance off, yet all_gather {calls}"
            return None
        # Contract 3: one all_gather per engine step, payload len(running), our group.
        want = [(len(self.scheduler.running), self.stand_in.group)]
        if calls != want:
            return f"balance_gather() sent {calls}, expected {want} (len(running))"
        return None


class GateOracle(Side):
    """The reference: upstream ``Scheduler`` whose WAITING admission is cut on frozen steps; none
    of our code. A step is frozen where the vector holds the cap (balance on). The oracle computes
    the vector itself: the scripted one (queue modes), or in ``oracle_gather`` the other ranks'
    scripted counts around its own ``len(running)``, as the real gather does.

    The gate sits right after upstream's own stop check in the WAITING loop: on a frozen step the
    loop body never runs, everything else of ``schedule()`` runs as upstream's (but for
    ``prefill_capacity_bound``, which a frozen step leaves as it was and this construction sets:
    only a throttled step reads it, and these workloads never throttle; tests/test_contract.py
    covers it). The oracle gets exactly
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

    def __init__(self, workload: Workload, mode: str) -> None:
        super().__init__(
            "upstream",
            factories.make_scheduler(vllm_config=vllm_config(workload, mode != "disabled")),
        )
        self.workload, self.mode = workload, mode
        # Before the first gather, the gate reads the constructor's zeros (nobody at the cap).
        self.gathered = [0] * workload.dp_size

    def before_schedule(self, step_index: int) -> None:
        if self.mode == "oracle_gather":
            self.vector = self.gathered
        else:
            self.vector = self.workload.vector(step_index, self.workload.dp_size)
        self.at_cap = max(self.vector) == self.workload.cap
        self.frozen = self.mode != "disabled" and self.at_cap
        if self.mode == "gate_open":
            assert not self.frozen, "gate_open workloads keep every rank below the cap"

    def schedule(self, throttle_prefills: bool):
        scheduler = self.scheduler
        if not self.frozen:
            return scheduler.schedule(throttle_prefills)
        # 0.31+ reads max_num_active_reqs only in that stop check (the assert reads the other).
        limit = admission_limit(scheduler)
        cap = getattr(scheduler, limit)
        setattr(scheduler, limit, len(scheduler.running))
        try:
            output = scheduler.schedule(throttle_prefills)
        finally:
            setattr(scheduler, limit, cap)
        # The construction's own check: a frozen step admits nothing from the waiting queues.
        assert not output.scheduled_new_reqs, "oracle admitted a new request on a frozen step"
        return output

    def after_step(self, step_index: int) -> None:
        if self.mode == "oracle_gather":  # what the gather after this step delivers
            self.gathered = self.workload.vector(step_index, self.workload.dp_size - 1)
            self.gathered.insert(0, len(self.scheduler.running))  # OtherRanks.rank

    def facts(self, output) -> set[str]:
        scheduler, found = self.scheduler, set()
        if self.frozen:
            found.add("frozen_step")
            waiting = scheduler.get_request_counts()[1] > 0
            if waiting and len(scheduler.running) < getattr(scheduler, admission_limit(scheduler)):
                found.add("frozen_with_room_and_waiting")
        elif output.scheduled_new_reqs:
            found.add("admitted")
            if self.at_cap:  # balance off: a gate reading the vector would have frozen here
                found.add("admitted_with_cap_in_vector")
        return found

    def context(self) -> str:
        vector = self.vector
        shown = vector if len(vector) <= 16 else f"{vector[:8]} ... (max {max(vector)})"
        return f"gathered vector {shown}, cap {self.workload.cap}"


def compare(workload: Workload, mode: str) -> Run:
    """Run ``workload`` on BalanceScheduler and on the reference in lockstep; raise Divergence
    at the first step whose observation differs. Returns what the run reached."""
    stand_in = OtherRanks(group=DPGroup(workload.dp_size))
    sides = [GateOracle(workload, mode), Ours(workload, mode, stand_in)]
    if mode == "disabled" and sides[1].scheduler.balance_gate is not None:
        diverged(workload, 0, "balance off, yet BalanceScheduler built a balance_gate")
    with collective(stand_in):
        return lockstep(workload, sides)


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
