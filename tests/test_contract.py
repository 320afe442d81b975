"""The behaviour contract (docs/design.md), items 1-4, on the scheduler the installed vLLM gets.

Runs unchanged on every path: compat (no seam) and shim (seam sessions), and with each
``balance_collective`` (the default all_gather and the opt-in recursive doubling).
"""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist
from async_kv_connector import kv_transfer_config, load_finished
from conftest import session_has_seam

import vllm_balance
from balance_testbed import factories, seam_differential
from vllm_balance.shim import collective

CAP = 4
ENABLED = {"enable_balance_scheduling": True}


@pytest.fixture(autouse=True, params=["all_gather", "recursive_doubling"])
def balance_collective(request, monkeypatch) -> str:
    """Every test here runs with each collective (tests/test_collective.py compares the two)."""
    monkeypatch.setitem(ENABLED, "balance_collective", request.param)
    return request.param


def balance_scheduler(dp_size: int = 2, enabled: bool = True, cls=None, **kwargs):
    return factories.make_scheduler(
        cls or vllm_balance.BalanceScheduler,
        data_parallel_size=dp_size,
        max_num_seqs=kwargs.pop("max_num_seqs", CAP),
        additional_config=ENABLED if enabled else {},
        **kwargs,
    )


def upstream_scheduler(cls=None, **kwargs):
    return factories.make_scheduler(cls, max_num_seqs=kwargs.pop("max_num_seqs", CAP), **kwargs)


def admitted(scheduler_output) -> list[str]:
    return [r.req_id for r in scheduler_output.scheduled_new_reqs]


def with_waiting(scheduler, n: int = 6, start: int = 0):
    factories.add_requests(scheduler, factories.make_requests(n, start=start))
    return scheduler


def test_session_runs_the_path_its_seam_flag_says():
    if session_has_seam() is None:
        pytest.skip("not running under a nox session")
    if session_has_seam():
        assert vllm_balance.active_path() == "shim"
    else:
        from vllm_balance.compat.pause_state import PAUSE_STATE, hold_for_installed_vllm

        expected = "pause-state" if hold_for_installed_vllm() == PAUSE_STATE else "compat"
        assert vllm_balance.active_path() == expected


# Contract 1: leader at cap => global freeze, compared with == against the configured cap.


def test_contract1_leader_at_cap_freezes_admission_on_this_rank():
    scheduler = with_waiting(balance_scheduler())
    scheduler.balance_gate.set_gathered([0, CAP])
    out = scheduler.schedule()
    assert admitted(out) == [] and out.total_num_scheduled_tokens == 0
    assert len(scheduler.waiting) == 6


def test_contract1_leader_at_cap_minus_one_does_not_freeze():
    scheduler = with_waiting(balance_scheduler())
    scheduler.balance_gate.set_gathered([0, CAP - 1])
    upstream = with_waiting(upstream_scheduler())
    assert (
        admitted(scheduler.schedule())
        == admitted(upstream.schedule())
        == [f"req-{i}" for i in range(CAP)]
    )


def test_contract1_is_not_catch_up_to_the_leader():
    # Leader at cap-1: "catch up" would cap this rank at 3; the contract admits up to the cap.
    scheduler = with_waiting(balance_scheduler())
    scheduler.balance_gate.set_gathered([0, CAP - 1])
    assert len(admitted(scheduler.schedule())) == CAP


def test_contract1_freeze_applies_to_every_rank_with_the_same_vector():
    ranks = [with_waiting(balance_scheduler(dp_size=3)) for _ in range(3)]
    for scheduler in ranks:
        scheduler.balance_gate.set_gathered([1, CAP, 0])
    assert [admitted(s.schedule()) for s in ranks] == [[], [], []]


def test_contract1_frozen_rank_keeps_decoding_its_running_requests():
    scheduler = with_waiting(balance_scheduler(), n=2)
    scheduler.balance_gate.set_gathered([0, 0])
    factories.step(scheduler)
    with_waiting(scheduler, n=2, start=2)
    scheduler.balance_gate.set_gathered([2, CAP])
    out = scheduler.schedule()
    assert admitted(out) == []
    assert out.num_scheduled_tokens == {"req-0": 1, "req-1": 1}


def test_contract1_gate_is_decided_once_per_step_from_the_gathered_counts():
    scheduler = with_waiting(balance_scheduler())
    scheduler.balance_gate.set_gathered([CAP, 0])
    scheduler.schedule()
    assert scheduler.balance_gate.frozen is True
    scheduler.balance_gate.set_gathered([0, 0])
    assert admitted(scheduler.schedule()) == [f"req-{i}" for i in range(CAP)]
    assert scheduler.balance_gate.frozen is False


def test_contract1_each_scheduler_owns_its_balance_state():
    """Two ranks in one process (the simulator's, a test's): counts set on one never reach the
    other, nor do its statistics. Negative control: the mutation run's
    ``balance_state_shared_between_schedulers``."""
    leader, other = (with_waiting(balance_scheduler()) for _ in range(2))
    leader.balance_gate.set_gathered([0, CAP])
    other.balance_gate.set_gathered([0, 0])
    assert admitted(leader.schedule()) == []
    assert admitted(other.schedule()) == [f"req-{i}" for i in range(CAP)]
    assert (leader.balance_gate.stats.frozen_steps, other.balance_gate.stats.frozen_steps) == (1, 0)


def has_admission_limit() -> bool:
    """vLLM 0.31+: ``max_num_active_seqs`` sets an admission limit below ``max_num_seqs``."""
    import dataclasses

    from vllm.config import SchedulerConfig

    return "max_num_active_seqs" in {f.name for f in dataclasses.fields(SchedulerConfig)}


needs_admission_limit = pytest.mark.skipif(
    not has_admission_limit(), reason="this vLLM has no max_num_active_seqs (before 0.31)"
)
ADMISSION_LIMITS = pytest.mark.parametrize(
    "limit", [CAP, CAP - 1], ids=["active-equals-max-num-seqs", "active-below-max-num-seqs"]
)


@needs_admission_limit
@ADMISSION_LIMITS
def test_contract1_cap_is_the_admission_limit_upstream_stops_at(limit):
    # max_num_seqs stays CAP; the WAITING loop (and the seam's default) stops at `limit`.
    scheduler = with_waiting(balance_scheduler(max_num_active_seqs=limit))
    assert scheduler.balance_gate.cap == scheduler.max_num_active_reqs == limit
    scheduler.balance_gate.set_gathered([0, limit])
    assert admitted(scheduler.schedule()) == []


@needs_admission_limit
@ADMISSION_LIMITS
def test_contract1_leader_below_the_admission_limit_admits_like_upstream(limit):
    balance = with_waiting(balance_scheduler(max_num_active_seqs=limit))
    balance.balance_gate.set_gathered([0, limit - 1])
    upstream = with_waiting(upstream_scheduler(max_num_active_seqs=limit))
    expected = [f"req-{i}" for i in range(limit)]
    assert admitted(balance.schedule()) == admitted(upstream.schedule()) == expected


@needs_admission_limit
def test_contract1_rank_full_at_an_admission_limit_below_max_num_seqs_freezes_the_others():
    # End to end: the leader fills up to max_num_active_seqs (never to max_num_seqs); its
    # len(running) is what the gather carries, and it must freeze the other rank.
    limit = CAP - 1
    leader, other = (with_waiting(balance_scheduler(max_num_active_seqs=limit)) for _ in range(2))
    leader.balance_gate.set_gathered([0, 0])
    factories.step(leader)
    assert len(leader.running) == limit
    other.balance_gate.set_gathered([len(leader.running), 0])
    assert admitted(other.schedule()) == []


# Contract 1 beside vLLM's prefill cadence (throttle_prefills, #44558): a frozen step is a
# policy, not a capacity limit, so it leaves prefill_capacity_bound as it was; a rank that stops
# on upstream's own slot check records it as upstream does (docs/design.md, Phase 2B).


def test_contract1_frozen_step_does_not_lift_the_prefill_throttle():
    balance, upstream = balance_scheduler(), upstream_scheduler()
    for scheduler in (balance, upstream):
        with_waiting(scheduler, n=1)
    balance.balance_gate.set_gathered([0, 0])
    factories.step(balance), factories.step(upstream)  # req-0 decodes from here on
    for scheduler in (balance, upstream):
        with_waiting(scheduler, n=3, start=1)
    balance.balance_gate.set_gathered([1, CAP])
    assert admitted(balance.schedule()) == []  # frozen: upstream has no such step
    assert balance.prefill_capacity_bound is upstream.prefill_capacity_bound is False

    balance.balance_gate.set_gathered([1, 0])
    # The throttled step defers prefill exactly as upstream's does, and the next one admits.
    assert admitted(balance.schedule(True)) == admitted(upstream.schedule(True)) == []
    expected = ["req-1", "req-2", "req-3"]
    assert admitted(balance.schedule()) == admitted(upstream.schedule()) == expected


def test_contract1_leader_at_cap_records_capacity_bound_as_upstream_does():
    balance, upstream = balance_scheduler(), upstream_scheduler()
    for scheduler in (balance, upstream):
        with_waiting(scheduler, n=CAP)
    balance.balance_gate.set_gathered([0, 0])
    factories.step(balance), factories.step(upstream)  # both at the cap, nothing waiting
    for scheduler in (balance, upstream):
        with_waiting(scheduler, n=2, start=CAP)
    assert balance.prefill_capacity_bound is upstream.prefill_capacity_bound is False

    balance.balance_gate.set_gathered([CAP, 0])  # this rank is the leader
    assert admitted(balance.schedule()) == admitted(upstream.schedule()) == []
    # Upstream's slot check stopped both before the gate: capacity-bound, as upstream records.
    assert balance.prefill_capacity_bound is upstream.prefill_capacity_bound is True


# Contract 1's scope: a freeze stops admitting *new* WAITING requests. Where vLLM keeps the
# requests that hold KV blocks in their own queue and drains it first (0.31+), a frozen step still
# schedules them, as vLLM's PAUSED_NEW does (0.32+); before 0.31 a frozen step holds them too,
# until it opens (docs/design.md, "what a hold blocks"). Both paths, side by side in one process.

PATHS = ("shim", "compat", "pause-state")


def drains_kv_holders(scheduler) -> bool:
    """Feature detection: the release's WAITING loop drains KV-holding requests first."""
    return hasattr(scheduler, "kv_holding_waiting")


def kv_holder_beside_a_fresh_request(scheduler, gathered=(0, 0)):
    """'req-0' decodes, 'kv-1' has finished its async KV load (it holds its blocks) and 'req-2'
    has just arrived."""
    factories.add_requests(
        scheduler, factories.make_requests(1) + factories.make_requests(1, prefix="kv", start=1)
    )
    if gathered is not None:
        scheduler.balance_gate.set_gathered(list(gathered))
    output = scheduler.schedule()  # req-0 prefills; kv-1's load starts
    runner_output = factories.model_runner_output(output, scheduler)
    scheduler.update_from_output(output, load_finished(runner_output, "kv-1"))
    return with_waiting(scheduler, n=1, start=2)


def hold_is_pause_state() -> bool:
    from vllm_balance.compat.pause_state import PAUSE_STATE, hold_for_installed_vllm

    return hold_for_installed_vllm() == PAUSE_STATE


def balance_on(path: str):
    paths = seam_differential.balance_on_each_path()
    if path not in paths:
        pytest.skip(f"no {path} path for this vLLM (only {sorted(paths)})")
    if path == "pause-state" and not hold_is_pause_state():
        pytest.skip("compat/fingerprints.json keeps the derived copy for this schedule()")
    return balance_scheduler(cls=paths[path], kv_transfer_config=kv_transfer_config())


@pytest.mark.parametrize("path", PATHS)
def test_contract1_frozen_step_holds_new_requests_not_kv_holders(path):
    scheduler = kv_holder_beside_a_fresh_request(balance_on(path))
    scheduler.balance_gate.set_gathered([1, CAP])
    out = scheduler.schedule()
    assert "req-2" not in out.num_scheduled_tokens
    assert scheduler.requests["req-2"].status.name == "WAITING"
    assert out.num_scheduled_tokens["req-0"] == 1
    kv_holder = scheduler.requests["kv-1"]
    if drains_kv_holders(scheduler):
        # Scheduled, its blocks in use: nothing is left pinned by a request the freeze parks.
        assert admitted(out) == ["kv-1"] and kv_holder in scheduler.running
        assert not scheduler.kv_holding_waiting
    else:
        # One mixed waiting queue: the frozen step ends the loop, the load waits for an open one.
        assert admitted(out) == []
        assert kv_holder.status.name == "WAITING_FOR_REMOTE_KVS"
        scheduler.balance_gate.set_gathered([1, 0])
        assert "kv-1" in scheduler.schedule().num_scheduled_tokens


def test_contract1_frozen_step_is_the_same_on_every_path_and_upstreams_paused_new():
    """Where vLLM's PAUSED_NEW drains KV-holders (0.32+) it is the reference; the paths this
    vLLM can have must all give its step (0.31: the derived copy's drains, PAUSED_NEW does not:
    the difference compat/fingerprints.json records)."""
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.scheduler import Scheduler

    paths = seam_differential.balance_on_each_path()
    upstream_cls = seam_differential.twins().unpatched if "shim" in paths else Scheduler
    upstream = kv_holder_beside_a_fresh_request(
        upstream_scheduler(upstream_cls, kv_transfer_config=kv_transfer_config()), gathered=None
    )
    upstream._pause_state = PauseState.PAUSED_NEW
    paused_new = factories.describe(upstream.schedule())
    outputs = {}
    for path in paths:
        scheduler = kv_holder_beside_a_fresh_request(
            balance_scheduler(cls=paths[path], kv_transfer_config=kv_transfer_config())
        )
        scheduler.balance_gate.set_gathered([1, CAP])
        outputs[path] = factories.describe(scheduler.schedule())
    if "shim" in outputs and "compat" in outputs:
        difference = factories.first_difference(outputs["shim"], outputs["compat"])
        assert difference is None, difference
    drained = "kv-1" in paused_new["num_scheduled_tokens"]
    if not drained and hasattr(upstream, "kv_holding_waiting"):
        # 0.31: PAUSED_NEW parks the KV-holder the contract's hold schedules.
        assert not hold_is_pause_state(), "PAUSED_NEW is not the hold here: keep the copy"
        assert "kv-1" in outputs["compat"]["num_scheduled_tokens"]
        return
    for path, output in outputs.items():
        difference = factories.first_difference(output, paused_new)
        assert difference is None, f"{path}: {difference}"


# Contract 2: gate open => the same SchedulerOutput as upstream, step by step.


def run_side_by_side(balance, upstream, steps: int, gathered=None):
    for step_index in range(steps):
        if gathered is not None:
            balance.balance_gate.set_gathered(gathered)
        ours, _ = factories.step(balance)
        theirs, _ = factories.step(upstream)
        difference = factories.first_difference(
            factories.describe(ours), factories.describe(theirs)
        )
        assert difference is None, f"step {step_index}: {difference}"


@pytest.mark.parametrize("enabled", [True, False], ids=["gate-open", "disabled"])
def test_contract2_same_outputs_as_upstream_over_a_multistep_run(enabled):
    kwargs = dict(num_gpu_blocks=64, max_num_batched_tokens=96, enable_prefix_caching=True)
    balance = balance_scheduler(enabled=enabled, **kwargs)
    upstream = upstream_scheduler(**kwargs)
    specs = factories.request_specs(12, prompt_len=70, max_tokens=9, shared_prefix=range(1, 33))
    for scheduler in (balance, upstream):
        factories.add_requests(scheduler, [factories.make_request(s) for s in specs])
    run_side_by_side(balance, upstream, steps=40, gathered=[CAP - 1, 0] if enabled else None)
    assert not balance.has_unfinished_requests() and not upstream.has_unfinished_requests()


# Contract 3: one all_gather per balance_gather(), payload len(running), the injected group.


def run_as_ranks(*calls, timeout: float = 60.0) -> list:
    """Run one call per DP rank concurrently (a collective blocks until every rank joins).

    Returns their results in rank order. A call that raised re-raises here, and one still
    running after ``timeout`` (a rank stuck in a collective) fails the test: a thread's
    exception or hang would otherwise only be a warning.
    """
    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = calls[rank]()
        except BaseException as exc:  # handed to the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    stuck = [rank for rank, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"ranks {stuck} still running after {timeout} s (stuck in a collective?)"
    if errors:
        raise errors[0]
    return results


def gloo_groups(world_size: int):
    """A real gloo group per rank, created concurrently (each rank blocks until all join)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group
    from vllm.utils.network_utils import get_open_port

    port = get_open_port()

    def join(rank: int):
        return lambda: stateless_init_torch_distributed_process_group(
            "127.0.0.1", port, rank, world_size, backend="gloo"
        )

    return run_as_ranks(*(join(rank) for rank in range(world_size)))


class AllGatherSpy:
    """Counts calls to torch.distributed.all_gather and forwards them to the real one."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, object]] = []
        self._real = dist.all_gather
        monkeypatch.setattr(dist, "all_gather", self)

    def __call__(self, tensor_list, tensor, group=None, async_op=False):
        self.calls.append((int(tensor.item()), group))
        return self._real(tensor_list, tensor, group=group, async_op=async_op)


def test_contract3_one_all_gather_of_len_running_on_the_injected_group(
    monkeypatch, balance_collective
):
    spy = AllGatherSpy(monkeypatch)
    reductions = []
    real_reduce = collective.reduce_running
    monkeypatch.setattr(
        collective,
        "reduce_running",
        lambda running, group, *timeout: (
            reductions.append((running, group)) or real_reduce(running, group, *timeout)
        ),
    )
    ranks = [with_waiting(balance_scheduler(), n=n) for n in (3, 1)]
    for scheduler in ranks:
        scheduler.balance_gate.set_gathered([0, 0])
        factories.step(scheduler)  # 3 and 1 running
    assert spy.calls == reductions == []  # schedule() never gathers (lesson A)
    groups = gloo_groups(2)
    for scheduler, group in zip(ranks, groups):
        scheduler.follow_dp_group(group)
    run_as_ranks(*(s.balance_gather for s in ranks))
    calls = sorted(spy.calls or reductions, key=lambda c: c[0])
    assert calls == [(1, groups[1]), (3, groups[0])]
    # The opt-in reduction instead of the all_gather, never both; it delivers the largest count,
    # all the gate reads, and no per-rank vector.
    assert (spy.calls and reductions) == []
    vector = [3, 1] if balance_collective == "all_gather" else []
    for scheduler in ranks:
        gate = scheduler.balance_gate
        assert (gate.leader, gate.stats.last_gathered) == (3, vector)


def test_contract3_one_gather_per_active_step_between_vllm_dp_syncs():
    # vLLM syncs engines_running on a wave's first step and every dp_sync_interval steps only,
    # returning True in between; the engine core triggers one gather on every step all the same.
    from vllm_balance.shim.engine_core import BalanceDPEngineCoreProc

    interval, steps = 4, 9
    ranks = [balance_scheduler() for _ in range(2)]
    if not hasattr(ranks[0].vllm_config.parallel_config, "dp_sync_interval"):
        pytest.skip("this vLLM syncs its DP ranks on every step (no dp_sync_interval)")
    engines = []
    for scheduler, group in zip(ranks, gloo_groups(2)):
        # What DPEngineCoreProc's own __init__ sets that its DP sync reads (no executor on CPU).
        engine = BalanceDPEngineCoreProc.__new__(BalanceDPEngineCoreProc)
        engine.vllm_config, engine.scheduler = scheduler.vllm_config, scheduler
        engine.step_counter, engine.dp_sync_interval, engine.pending_pause = 0, interval, False
        engine.enable_fault_tolerance = False  # read by the sync from 0.34 on
        engine.dp_group = group  # handed to the scheduler, as at start-up
        engines.append(engine)

    def busy_loop(engine):  # no rank has work: a step that syncs says so, the others say True
        return [engine._has_global_unfinished_reqs(False) for _ in range(steps)]

    results = run_as_ranks(*(lambda engine=engine: busy_loop(engine) for engine in engines))
    assert results[0] == results[1]
    synced = [step for step, running in enumerate(results[0], start=1) if not running]
    assert synced == [1, 4, 8]
    assert [scheduler.balance_gate.stats.gathers for scheduler in ranks] == [steps, steps]


def frozen_after_gather_with_rank0_paused(pause, monkeypatch, widened=False) -> list[bool]:
    """Rank 0 at the cap and paused by an operator, rank 1 below it; each rank's gate after one
    real gather. ``widened``: the wrong rule, every paused rank gathering 0."""
    from vllm_balance.shim import scheduler as mixin

    ranks = [with_waiting(balance_scheduler(), n=n) for n in (CAP, 1)]
    for scheduler in ranks:
        scheduler.balance_gate.set_gathered([0, 0])
        factories.step(scheduler)  # CAP and 1 running
    ranks[0]._pause_state = pause  # as set_pause_state() sets it, without its log line
    for scheduler, group in zip(ranks, gloo_groups(2)):
        scheduler.follow_dp_group(group)
    with monkeypatch.context() as patched:
        if widened:
            patched.setattr(mixin, "PAUSED_ALL", pause)
        run_as_ranks(*(s.balance_gather for s in ranks))
    return [r.balance_gate.leader_at_cap() for r in ranks]


def test_contract1_a_wait_paused_rank_at_the_cap_freezes_the_others_a_keep_paused_one_not(
    monkeypatch,
):
    """``/pause?mode=wait`` (``PAUSED_NEW``) still runs the rank's requests at the cap, so it
    gathers ``len(running)`` and every rank freezes; only ``mode="keep"`` (``PAUSED_ALL``), which
    runs nothing, gathers 0 (shim/scheduler.py). Negative control: every paused rank gathering 0
    un-freezes the wait case."""
    from vllm_balance.shim import scheduler as mixin

    if mixin.PAUSED_ALL is None:
        pytest.skip("this vLLM has no scheduler pause states")
    from vllm.v1.core.sched.interface import PauseState

    wait, keep = PauseState.PAUSED_NEW, PauseState.PAUSED_ALL
    assert frozen_after_gather_with_rank0_paused(wait, monkeypatch) == [True, True]
    assert frozen_after_gather_with_rank0_paused(keep, monkeypatch) == [False, False]
    widened = frozen_after_gather_with_rank0_paused(wait, monkeypatch, widened=True)
    assert widened == [False, False]  # what the first assertion catches


def test_contract3_gather_is_a_noop_until_a_group_is_injected(monkeypatch):
    spy = AllGatherSpy(monkeypatch)
    monkeypatch.setattr(collective, "reduce_running", None)  # a call would raise
    scheduler = balance_scheduler()
    scheduler.balance_gather()
    assert spy.calls == []


# Contract 4: disabled path untouched.


def test_contract4_disabled_allocates_nothing_and_never_gathers(monkeypatch):
    spy = AllGatherSpy(monkeypatch)
    scheduler = with_waiting(balance_scheduler(enabled=False))
    assert scheduler.balance_gate is None
    [group] = gloo_groups(1)
    scheduler.follow_dp_group(group)
    for _ in range(5):
        factories.step(scheduler)
        scheduler.balance_gather()
    assert spy.calls == []
    assert scheduler.balance_gate is None


@pytest.mark.parametrize("enabled", [True, False], ids=["on", "off"])
def test_contract4_balance_adds_one_attribute_to_vllms_scheduler(enabled):
    """All balance state is one object, ``balance_gate`` (None with balance off): no second
    attribute for an upstream rename to collide with, nothing allocated when off. Negative
    control: the mutation run's ``disabled_allocates_a_buffer``."""
    scheduler = balance_scheduler(enabled=enabled)
    upstream = factories.make_scheduler(vllm_config=scheduler.vllm_config)
    assert set(vars(scheduler)) - set(vars(upstream)) == {"balance_gate"}
    assert (scheduler.balance_gate is not None) is enabled


def test_contract4_disabled_schedule_delegates_to_upstream(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    calls = []
    real = Scheduler.schedule

    def recording(self, throttle_prefills=False):
        calls.append(throttle_prefills)
        return real(self, throttle_prefills)

    monkeypatch.setattr(Scheduler, "schedule", recording)
    scheduler = with_waiting(balance_scheduler(enabled=False))
    scheduler.schedule(throttle_prefills=True)
    assert calls == [True]
