"""The pause-state hold against the contract's hold: what decides that a release is served by it.

The candidate is ``compat/pause_state.py``'s scheduler (a frozen step is upstream's ``schedule()``
under a one-step ``PAUSED_NEW``); the reference is the contract's hold in real code: the seam's
(the shim on the installed vLLM with its series applied) where a series serves the release, else
the derived copy's. Both run in ``lockstep`` on generated multi-step workloads with requests
whose KV comes from a remote store (async loads finishing a few steps later:
``WAITING_FOR_REMOTE_KVS``, then the KV-holding queue), structured-output requests waiting on
their grammar, preemption (small KV caches) and aborts, under scripted gathered vectors that put
a rank at the cap on some steps. Every step compares the whole observation (outputs, queues,
per-request progress, free blocks) and the hold's own bookkeeping (``balance_gate.deferred``,
``prefill_capacity_bound``).

Not generated: streaming-input sessions and the P/D decode side (balance refuses a KV consumer:
contract 5). On a release without series or copy (0.34+) the reference is gone: there the
gate-oracle differential (tests/test_gate_oracle.py, whose BalanceScheduler is this path) covers
every queue without a connector, and tests/test_async_kv_hold.py each async-KV case.
"""

from __future__ import annotations

from collections import Counter

import pytest
from async_kv_connector import kv_transfer_config, load_finished
from balance_differential import property_settings, workloads
from hypothesis import example, given
from hypothesis import strategies as st

from balance_testbed import factories, seam_differential
from balance_testbed.factories import Divergence
from balance_testbed.lockstep import Gathered, Req, Side, Workload, lockstep
from vllm_balance.compat.pause_state import PauseStateHold

AT_CAP, OPEN = Gathered(top=3, n_top=1, rest=0), Gathered(top=1, n_top=2, rest=0)


def reference_cls() -> type:
    """The contract's hold in code for the installed vLLM: the seam's, else the derived copy's."""
    paths = seam_differential.balance_on_each_path()
    for name in ("shim", "compat"):
        if name in paths:
            return paths[name]
    pytest.skip(f"no seam series and no derived copy serve this vLLM: {sorted(paths)} only")


def pause_state_cls() -> type:
    return seam_differential.balance_on_each_path()["pause-state"]


class Held(Side):
    """A balance scheduler fed the workload's gathered vector before each step, with the async
    KV loads that started ``kv_load_steps`` steps ago reported finished after it."""

    def __init__(self, cls: type, workload: Workload, reference: Held | None = None) -> None:
        config = factories.make_vllm_config(
            max_num_seqs=workload.cap,
            max_num_batched_tokens=workload.max_num_batched_tokens,
            long_prefill_token_threshold=workload.long_prefill_token_threshold,
            num_gpu_blocks=workload.num_gpu_blocks,
            enable_prefix_caching=workload.enable_prefix_caching,
            data_parallel_size=workload.dp_size,
            additional_config={"enable_balance_scheduling": True},
            kv_transfer_config=kv_transfer_config(),
        )
        super().__init__(cls.__name__, factories.make_scheduler(cls, vllm_config=config))
        self.workload, self.reference = workload, reference
        self.load_steps = {r.request_id: r.kv_load_steps for r in workload.requests}
        self.loads: dict[str, int] = {}  # request id -> step its load started
        self.loaded: set[str] = set()
        self.step_index = 0

    def before_schedule(self, step_index: int) -> None:
        self.step_index = step_index
        vector = self.workload.vector(step_index, self.workload.dp_size)
        self.scheduler.balance_gate.set_gathered(vector)

    def step(self, throttle_prefills: bool = False):
        output = self.schedule(throttle_prefills)
        scheduler = self.scheduler
        for request_id, request in scheduler.requests.items():
            waits = request.status.name == "WAITING_FOR_REMOTE_KVS"
            if waits and request_id not in self.loaded:
                self.loads.setdefault(request_id, self.step_index)
        done = [
            rid
            for rid, started in self.loads.items()
            if self.step_index - started >= (self.load_steps.get(rid) or 0)
        ]
        for request_id in done:
            del self.loads[request_id]
            self.loaded.add(request_id)  # reported once, as a worker reports it
        runner_output = load_finished(factories.model_runner_output(output, scheduler), *done)
        engine_outputs = scheduler.update_from_output(output, runner_output)
        return output, factories.observe(scheduler, output, engine_outputs)

    def after_step(self, step_index: int) -> str | None:
        if self.reference is None:
            return None
        ours, theirs = self.scheduler, self.reference.scheduler
        for name, mine, theirs_value in (
            ("frozen", ours.balance_gate.frozen, theirs.balance_gate.frozen),
            ("deferred", ours.balance_gate.deferred, theirs.balance_gate.deferred),
            ("prefill_capacity_bound", ours.prefill_capacity_bound, theirs.prefill_capacity_bound),
        ):
            if mine != theirs_value:
                return f"{name}: {mine} here, {theirs_value} in the reference"
        return None

    def facts(self, output) -> set[str]:
        found = set()
        if self.scheduler.balance_gate.frozen:
            found.add("frozen_step")
            if self.scheduler.balance_gate.deferred:
                found.add("held_a_fresh_request")
            if any(r.req_id.startswith("kv-") for r in output.scheduled_new_reqs):
                found.add("kv_holder_scheduled_while_frozen")
        if self.loads:
            found.add("async_kv_load_in_flight")
        return found


def compare(candidate: type, workload: Workload) -> Counter:
    reference = Held(reference_cls(), workload)
    return lockstep(workload, [reference, Held(candidate, workload, reference)]).facts


@st.composite
def kv_workloads(draw) -> Workload:
    """The balance differential's workloads with a rank at the cap on some steps, some requests'
    KV in the remote store (their loads finish 0-3 steps after they start)."""
    workload = draw(workloads(at_cap=True))
    requests = tuple(
        Req(**{**vars(r), "kv_load_steps": draw(st.none() | st.integers(0, 3))})
        for r in workload.requests
    )
    return Workload(**{**vars(workload), "requests": requests})


def two_ranks(requests: tuple[Req, ...], gathered: tuple[Gathered, ...]) -> Workload:
    """A named workload: cap 3 on DP=2, room in the KV cache and the token budget."""
    return Workload(
        cap=3,
        max_num_batched_tokens=2048,
        num_gpu_blocks=1000,
        enable_prefix_caching=False,
        dp_size=2,
        requests=requests,
        gathered=gathered,
    )


# A finished load waits beside a fresh request while the leader is at the cap, then it opens.
KV_HOLDER_AND_FRESH = two_ranks(
    (
        Req(index=0, prefix=0, tail=8, max_tokens=6, arrive=0),
        Req(index=1, prefix=0, tail=8, max_tokens=4, arrive=0, kv_load_steps=1),
        Req(index=2, prefix=0, tail=8, max_tokens=3, arrive=2),
        Req(index=3, prefix=0, tail=8, max_tokens=3, arrive=3, grammar_ready=5),
    ),
    (OPEN, AT_CAP, AT_CAP, OPEN, AT_CAP, OPEN),
)
REACHES = {"frozen_step", "held_a_fresh_request", "async_kv_load_in_flight", "preemption"}


def test_pause_state_hold_is_the_contracts_hold_on_generated_workloads():
    reached: Counter = Counter()
    candidate = pause_state_cls()

    @property_settings(max_examples=60)
    @given(workload=kv_workloads())
    @example(workload=KV_HOLDER_AND_FRESH)
    def same_as_reference(workload):
        reached.update(compare(candidate, workload))

    same_as_reference()
    assert REACHES <= set(reached), f"never reached: {REACHES - set(reached)}"


# Negative controls: deliberately wrong holds the differential must catch.


class HeldOneStepTooLong(PauseStateHold):
    """The pause left in place for the step after a frozen one."""

    def schedule(self, throttle_prefills: bool = False):
        from vllm.v1.core.sched.interface import PauseState

        lingering = getattr(self, "_linger", False)
        if lingering and not self.balance_gate.leader_at_cap():
            self._pause_state = PauseState.PAUSED_NEW
        try:
            return super().schedule(throttle_prefills)
        finally:
            if lingering:
                self._pause_state = PauseState.UNPAUSED
            self._linger = self.balance_gate.frozen


class PausedAll(PauseStateHold):
    """``PAUSED_ALL`` where the hold is ``PAUSED_NEW``: running requests stop too."""

    def _hold_and_schedule(self, throttle_prefills: bool):
        from vllm.v1.core.sched.interface import PauseState

        self._pause_state = PauseState.PAUSED_ALL
        try:
            return self._upstream_schedule(throttle_prefills), False
        finally:
            self._pause_state = PauseState.UNPAUSED


@pytest.mark.parametrize("wrong", [HeldOneStepTooLong, PausedAll], ids=lambda c: c.__name__)
def test_negative_control_a_wrong_hold_diverges(wrong):
    right = pause_state_cls()
    reference_cls()  # skips where there is nothing to compare with
    candidate = type(wrong.__name__, (wrong, *right.__bases__[1:]), {})
    with pytest.raises(Divergence):
        compare(candidate, KV_HOLDER_AND_FRESH)


# The same wrong holds against the gate oracle (upstream's own Scheduler with admission cut by
# construction, tests/balance_differential.py): the reference every release has, 0.34+ included.
FROZEN_THEN_OPEN = two_ranks(
    (
        Req(index=0, prefix=0, tail=8, max_tokens=8, arrive=0),
        Req(index=1, prefix=0, tail=8, max_tokens=3, arrive=1),
        Req(index=2, prefix=0, tail=8, max_tokens=3, arrive=2),
    ),
    (OPEN, AT_CAP, OPEN, OPEN),
)


@pytest.mark.parametrize("wrong", [HeldOneStepTooLong, PausedAll], ids=lambda c: c.__name__)
def test_negative_control_a_wrong_hold_diverges_from_the_gate_oracle(monkeypatch, wrong):
    from balance_differential import compare as oracle_compare

    import vllm_balance
    from vllm_balance.compat.pause_state import PauseStateBalanceScheduler

    oracle_compare(FROZEN_THEN_OPEN, "oracle_queue")  # the right hold: no divergence
    bases = PauseStateBalanceScheduler.__bases__[1:]
    monkeypatch.setattr(vllm_balance, "BalanceScheduler", type(wrong.__name__, (wrong, *bases), {}))
    with pytest.raises(Divergence):
        oracle_compare(FROZEN_THEN_OPEN, "oracle_queue")
