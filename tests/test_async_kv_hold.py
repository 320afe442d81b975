"""What a frozen step means for async KV loads where vLLM queues them apart (0.34+).

vLLM 0.34 keeps fresh requests that its connector may load asynchronously in their own queue,
``async_kv_waiting`` (with ``--max-num-inflight-kv-loads``), and starts their loads even while the
running batch is full. **Decision: a frozen step starts no load**, as vLLM's own ``PAUSED_NEW``:
a load allocates the request's KV blocks, so starting it is admitting it (the blocks are then
pinned until a slot opens, the cost the hold exists to avoid); requests whose load finished hold
their blocks already and drain, as under ``PAUSED_NEW``. The alternative, loads start but no
fresh compute, would need a vLLM change and keep blocks pinned through a freeze
(docs/design.md, "The pause-state hold"). Each queue and both arrival orders, against upstream's
own ``Scheduler`` under a one-step ``PAUSED_NEW`` (the definition) and, once the gate opens,
unpaused (contract 2).
"""

from __future__ import annotations

import pytest
from async_kv_connector import kv_transfer_config, load_finished

import vllm_balance
from balance_testbed import factories

CAP = 4
ARRIVALS = {"remote-first": ("kv", "req"), "local-first": ("req", "kv")}


def scheduler(cls=None, enabled: bool = True):
    config = factories.make_vllm_config(
        max_num_seqs=CAP,
        data_parallel_size=2,
        additional_config={"enable_balance_scheduling": True} if enabled else {},
        kv_transfer_config=kv_transfer_config(),
    )
    if not hasattr(config.scheduler_config, "max_num_inflight_kv_loads"):
        pytest.skip("this vLLM has one fresh waiting queue (no async_kv_waiting before 0.34)")
    config.scheduler_config.max_num_inflight_kv_loads = 4
    return factories.make_scheduler(cls, vllm_config=config)


def arrive(scheduler, order: tuple[str, ...], start: int) -> list[str]:
    requests = [
        factories.make_requests(1, prefix=p, start=start + i)[0] for i, p in enumerate(order)
    ]
    factories.add_requests(scheduler, requests)
    return [r.request_id for r in requests]


def upstream_paused_new(upstream):
    from vllm.v1.core.sched.interface import PauseState

    upstream._pause_state = PauseState.PAUSED_NEW
    try:
        return upstream.schedule()
    finally:
        upstream._pause_state = PauseState.UNPAUSED


@pytest.mark.parametrize("order", sorted(ARRIVALS))
def test_a_frozen_step_starts_no_async_load_and_admits_no_fresh_request(order):
    balance, upstream = scheduler(vllm_balance.BalanceScheduler), scheduler(enabled=False)
    ids = [arrive(s, ARRIVALS[order], start=0) for s in (balance, upstream)][0]
    assert balance.async_kv_waiting and balance.waiting  # one request in each fresh queue
    balance.balance_gate.set_gathered([1, CAP])  # the other rank is at the cap
    held, paused = balance.schedule(), upstream_paused_new(upstream)
    difference = factories.first_difference(factories.describe(held), factories.describe(paused))
    assert difference is None, difference
    assert held.scheduled_new_reqs == [] and held.num_scheduled_tokens == {}
    for request_id in ids:  # no blocks allocated: neither was admitted, no load started
        assert balance.requests[request_id].status.name == "WAITING"
        assert not balance.kv_cache_manager.get_block_ids(request_id)[0]
    assert balance.balance_gate.deferred

    balance.balance_gate.set_gathered([1, 0])  # open: exactly upstream's step
    opened, theirs = balance.schedule(), upstream.schedule()
    difference = factories.first_difference(factories.describe(opened), factories.describe(theirs))
    assert difference is None, difference
    assert (
        balance.requests[ids[ARRIVALS[order].index("kv")]].status.name == "WAITING_FOR_REMOTE_KVS"
    )


def test_a_finished_load_is_scheduled_on_a_frozen_step():
    balance, upstream = scheduler(vllm_balance.BalanceScheduler), scheduler(enabled=False)
    for s in (balance, upstream):
        arrive(s, ("kv",), start=0)
    balance.balance_gate.set_gathered([0, 0])
    for s in (balance, upstream):  # kv-0's load starts, then finishes
        output = s.schedule()
        s.update_from_output(
            output, load_finished(factories.model_runner_output(output, s), "kv-0")
        )
        arrive(s, ("kv", "req"), start=1)
    balance.balance_gate.set_gathered([1, CAP])
    held, paused = balance.schedule(), upstream_paused_new(upstream)
    difference = factories.first_difference(factories.describe(held), factories.describe(paused))
    assert difference is None, difference
    assert [r.req_id for r in held.scheduled_new_reqs] == ["kv-0"]
    assert balance.requests["kv-1"].status.name == "WAITING"  # its load did not start
