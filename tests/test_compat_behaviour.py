"""Phase 2A facts the path-independent suites cannot show: compat schedulers against upstream
ones, real vLLM, same requests.

tests/test_contract.py runs contracts 1-4 on the compat path too (the sync class, in the
sessions without the seam); here are the async class and delta 3. Each test builds an upstream
scheduler and a compat one from equal configs (DP=2, as balance needs), feeds both the same
requests and compares the ``SchedulerOutput``s (their reprs carry every field).
"""

from __future__ import annotations

import pytest
from conftest import no_derived_copy_reason
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_balance.selection import has_seam

if has_seam():
    # The seam sessions run the shim; compat is never selected there (and would rightly
    # refuse the seamed schedule() as unverified). Its drift test runs in the compat sessions.
    pytest.skip("vLLM has the seam: the compat path is not used", allow_module_level=True)
if reason := no_derived_copy_reason():
    pytest.skip(reason, allow_module_level=True)

from balance_testbed.factories import (
    make_request,
    make_scheduler,
    request_specs,
    step,
)
from vllm_balance.compat.scheduler import CompatBalanceAsyncScheduler, CompatBalanceScheduler

CAP = 4
ENABLED = {"enable_balance_scheduling": True}


def build_pair(upstream_cls, compat_cls, additional_config=None, **config):
    """(upstream, compat) schedulers from equal configs."""
    config = dict(
        max_num_seqs=CAP, data_parallel_size=2, additional_config=additional_config, **config
    )
    return make_scheduler(upstream_cls, **config), make_scheduler(compat_cls, **config)


def add_to_both(schedulers, specs) -> None:
    for scheduler in schedulers:
        for spec in specs:
            scheduler.add_request(make_request(spec))


def new_ids(output) -> list[str]:
    return [req.req_id for req in output.scheduled_new_reqs]


def start_with_two_running(upstream_cls, compat_cls, async_scheduling):
    """Both schedulers with 2 running requests (below CAP) and 4 waiting ones."""
    upstream, compat = build_pair(
        upstream_cls, compat_cls, ENABLED, async_scheduling=async_scheduling
    )
    add_to_both((upstream, compat), request_specs(2))
    compat.balance_gate.set_gathered([0, 0])
    (upstream_output, _), (compat_output, _) = step(upstream), step(compat)
    assert new_ids(upstream_output) == new_ids(compat_output) == ["req-0", "req-1"]
    add_to_both((upstream, compat), request_specs(4, start=2))
    return upstream, compat


def test_async_compat_scheduler_freezes_at_cap_and_admits_like_upstream_below():
    """The derived body under AsyncScheduler (tests/test_contract.py runs the sync class)."""
    upstream, compat = start_with_two_running(AsyncScheduler, CompatBalanceAsyncScheduler, True)
    compat.balance_gate.set_gathered([CAP, 0])  # the other rank is at the cap; this one is not
    upstream_output, compat_output = upstream.schedule(), compat.schedule()
    assert new_ids(upstream_output) == ["req-2", "req-3"]
    assert new_ids(compat_output) == []
    # Only admission stops: the running requests are still scheduled.
    assert set(compat_output.num_scheduled_tokens) == {"req-0", "req-1"}
    assert len(compat.waiting) == 4

    upstream, compat = start_with_two_running(AsyncScheduler, CompatBalanceAsyncScheduler, True)
    compat.balance_gate.set_gathered([CAP - 1, 0])
    # Not "catch up to the leader": this rank fills to its own cap, past the leader's CAP - 1.
    assert repr(compat.schedule()) == repr(upstream.schedule())


@pytest.mark.skipif(
    not hasattr(Scheduler, "_select_waiting_queue_for_scheduling"),
    reason="no queue selection to assert on (0.31+): delta 3 does not apply",
)
def test_delta3_no_waiting_queue_breaks_where_upstream_asserts(monkeypatch):
    # Unreachable with real state: the WAITING loop runs only while a queue is non-empty and
    # nothing between its condition and the selection dequeues. A subclass (or plugin) that
    # overrides the selection can still return None: compat then ends admission cleanly.
    upstream, compat = start_with_two_running(Scheduler, CompatBalanceScheduler, False)
    for scheduler in (upstream, compat):
        monkeypatch.setattr(scheduler, "_select_waiting_queue_for_scheduling", lambda: None)
    with pytest.raises(AssertionError):
        upstream.schedule()
    compat_output = compat.schedule()
    assert new_ids(compat_output) == []
    assert set(compat_output.num_scheduled_tokens) == {"req-0", "req-1"}
