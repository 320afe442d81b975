"""In one process: a blocked gather must not look healthy.

The watchdog's decisions are checked on a clock the test sets (``GatherWatchdog.check(now)``), its
thread and the scheduler's part on real gloo groups. The multi-process acceptance (a paused engine
core, the lesson-A control) is in ``tests/multiproc/test_watchdog.py`` and ``test_deadlocks.py``.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

import pytest
import torch.distributed as dist
from test_contract import CAP, gloo_groups

import vllm_balance
from balance_testbed import factories
from balance_testbed.waiting import wait_for
from tests.multiproc.watchdog_log import WatchdogLine, watchdog_lines
from vllm_balance.log import LOGGER_NAME
from vllm_balance.shim.stats import BalanceStats
from vllm_balance.shim.watchdog import (
    BLOCKED,
    FAILED,
    MAX_REPEAT_S,
    UNBLOCKED,
    GatherWatchdog,
)

pytestmark = pytest.mark.path_independent

WARN_S = 1.0


def watchdog_after_one_gather() -> GatherWatchdog:
    stats = BalanceStats()
    stats.record_gather([3, 1])
    return GatherWatchdog(WARN_S, dp_rank=1, dp_size=2, stats=stats)


def messages(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER_NAME]


def lines(caplog) -> list[WatchdogLine]:
    return watchdog_lines("\n".join(messages(caplog)))


# The watchdog's decisions, on a clock the test sets


def test_blocked_gather_does_not_look_healthy_one_error_after_warn_s(caplog):
    watchdog = watchdog_after_one_gather()
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert watchdog.check(100.0) == WARN_S  # nothing in flight: look again in warn_s
        watchdog.started = 100.0
        assert watchdog.check(100.4) == pytest.approx(WARN_S - 0.4)  # wake when it is warn_s old
        assert messages(caplog) == []
        watchdog.check(101.0)
    [record] = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert record.levelno == logging.ERROR
    assert record.getMessage().startswith(
        f"{BLOCKED}: DP1 has waited 1.0 s in gather #2 of 2 DP ranks; "
        "last gathered running counts (gather #1): DP0=3 DP1=1; "
        f"a rank that logs no '{BLOCKED}' line for gather #2 has not entered it"
    )


def test_blocked_gather_error_repeats_as_the_wait_doubles_at_most_every_max_repeat_s(caplog):
    watchdog = watchdog_after_one_gather()
    watchdog.started = 0.0
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        now = WARN_S
        while now < 300:
            now += watchdog.check(now)  # as the thread does: sleep what check() returns
    waits = [line.seconds for line in lines(caplog)]
    assert waits[:7] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
    gaps = [later - earlier for earlier, later in zip(waits, waits[1:])]
    assert max(gaps) == pytest.approx(MAX_REPEAT_S, abs=0.11)
    assert watchdog.stats.blocked_gathers == 1  # one gather, however many lines


def test_after_a_resize_the_error_names_the_new_group_and_numbers_its_gathers_from_one(caplog):
    # An elastic-EP resize: the scheduler hands the new rank and size over, clears the vector of
    # the old group (tests/multiproc/test_resize.py runs vLLM's own resize).
    watchdog = watchdog_after_one_gather()
    watchdog.stats.last_gathered = []
    watchdog.follow(dp_rank=2, dp_size=3)
    watchdog.started = 0.0
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        watchdog.check(WARN_S)
    [message] = messages(caplog)
    assert message.startswith(
        f"{BLOCKED}: DP2 has waited 1.0 s in gather #1 of 3 DP ranks; "
        "last gathered running counts: none yet;"
    ), message


def test_blocked_reduction_names_the_last_max_and_min_it_has_no_per_rank_counts(caplog):
    stats = BalanceStats()
    stats.record_reduced(maximum=4, minimum=1, total=9, dp_size=3)  # recursive_doubling
    watchdog = GatherWatchdog(WARN_S, dp_rank=2, dp_size=3, stats=stats)
    watchdog.started = 0.0
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        watchdog.check(WARN_S)
    [message] = messages(caplog)
    assert message.startswith(
        f"{BLOCKED}: DP2 has waited 1.0 s in gather #2 of 3 DP ranks; last gathered running "
        "counts (gather #1): max 4, min 1 (reduced, no per-rank counts); a rank that logs no"
    )
    assert [line.rank for line in lines(caplog)] == [2]  # the alerting pattern still matches


def test_return_of_a_reported_gather_is_logged_once_with_its_wait(caplog):
    watchdog = watchdog_after_one_gather()
    watchdog.started = 10.0
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        watchdog.check(11.5)
        watchdog.started = None  # the gather returned
        watchdog.stats.record_gather([2, 2])
        watchdog.check(17.3)
        watchdog.check(18.0)
    blocked, unblocked = messages(caplog)
    assert (
        unblocked
        == f"{UNBLOCKED}: DP1 gather #2 returned after 7.3 s (blocked gathers on this rank: 1)"
    )
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.WARNING]
    assert watchdog.stats.longest_gather_wait_s == pytest.approx(7.3)


def test_a_reported_gather_that_raised_is_logged_as_failed_with_its_exception(caplog):
    watchdog = watchdog_after_one_gather()
    watchdog.started = 10.0
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        watchdog.check(11.5)
        watchdog.raised = RuntimeError("Connection reset by peer")  # what the gather does
        watchdog.started = None
        watchdog.check(18.1)
    blocked, failed = messages(caplog)
    assert failed == (
        f"{FAILED}: DP1 gather #2 raised after 8.1 s: RuntimeError: Connection reset by peer "
        "(blocked gathers on this rank: 1)"
    )
    assert not any(UNBLOCKED in m for m in messages(caplog))
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]


def test_unreported_gathers_log_nothing(caplog):
    watchdog = watchdog_after_one_gather()
    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        for step in range(100):
            watchdog.started = step * 0.5
            watchdog.check(step * 0.5 + 0.9 * WARN_S)
            watchdog.started = None
            watchdog.check(step * 0.5 + 0.95 * WARN_S)
    assert messages(caplog) == []
    assert watchdog.stats.blocked_gathers == 0


def test_next_gather_blocking_before_the_watchdog_looks_again_is_a_new_report(caplog):
    watchdog = watchdog_after_one_gather()
    watchdog.started = 0.0
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        watchdog.check(1.0)  # gather #2 reported
        watchdog.stats.record_gather([1, 1])  # it returned ...
        watchdog.started = 1.05  # ... and gather #3 started before the next look
        watchdog.check(2.5)
    assert [(line.kind, line.gather) for line in lines(caplog)] == [
        ("blocked", 2),
        ("unblocked", 2),
        ("blocked", 3),
    ]
    assert watchdog.stats.blocked_gathers == 2


def test_stats_line_shows_gather_blocked():
    stats = BalanceStats(blocked_gathers=2, longest_gather_wait_s=7.25)
    assert stats.log_line(3).endswith("gather blocked=2 (longest 7.2 s)")
    assert BalanceStats().log_line(0).endswith("gather blocked=0 (longest 0.0 s)")


# The scheduler's part, on real gloo groups


def gathering_scheduler(dp_rank: int = 0, dp_size: int = 2, **additional):
    config = factories.make_vllm_config(
        data_parallel_size=dp_size,
        max_num_seqs=CAP,
        additional_config={"enable_balance_scheduling": True, **additional},
    )
    config.parallel_config.data_parallel_rank = dp_rank
    return factories.make_scheduler(vllm_balance.BalanceScheduler, config)


@pytest.mark.parametrize("collective", ["all_gather", "recursive_doubling"])
def test_peer_late_to_the_gather_is_reported_by_the_rank_waiting_in_it(caplog, collective):
    ranks = [
        gathering_scheduler(r, balance_gather_warn_s=0.3, balance_collective=collective)
        for r in (0, 1)
    ]
    for scheduler, group in zip(ranks, gloo_groups(2)):
        scheduler.follow_dp_group(group)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        waiting = threading.Thread(target=ranks[0].balance_gather)
        waiting.start()
        time.sleep(1.0)  # rank 1 is late: rank 0 waits in the all_gather
        ranks[1].balance_gather()
        waiting.join(timeout=30)
        wait_for(lambda: any(UNBLOCKED in m for m in messages(caplog)), 10, 0.05)
    blocked = [m for m in messages(caplog) if m.startswith(BLOCKED)]
    unblocked = [m for m in messages(caplog) if m.startswith(UNBLOCKED)]
    assert blocked and all(m.startswith(f"{BLOCKED}: DP0 ") for m in blocked), blocked
    assert "in gather #1 of 2 DP ranks; last gathered running counts: none yet;" in blocked[0]
    assert len(unblocked) == 1 and unblocked[0].startswith(f"{UNBLOCKED}: DP0 gather #1 ")
    stats = [scheduler.balance_gate.stats for scheduler in ranks]
    assert (stats[0].blocked_gathers, stats[1].blocked_gathers) == (1, 0)
    assert stats[0].gathers == 1


def test_watchdog_is_one_thread_per_scheduler_started_by_its_first_gather():
    scheduler = gathering_scheduler(dp_size=1)
    assert not scheduler.balance_gate.watchdog.running  # one that never gathered has no thread
    scheduler.follow_dp_group(*gloo_groups(1))
    before = threading.active_count()
    for _ in range(20):
        scheduler.balance_gather()
    watchdog = scheduler.balance_gate.watchdog
    assert watchdog.running and threading.active_count() == before + 1
    assert watchdog.started is None
    thread = watchdog._thread
    del scheduler, watchdog
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()  # it ends with its scheduler


def test_zero_warn_s_turns_the_watchdog_off():
    scheduler = gathering_scheduler(dp_size=1, balance_gather_warn_s=0)
    scheduler.follow_dp_group(*gloo_groups(1))
    before = threading.active_count()
    scheduler.balance_gather()
    assert not scheduler.balance_gate.watchdog.running and threading.active_count() == before


def test_failed_gather_is_not_reported_as_blocked(monkeypatch):
    scheduler = gathering_scheduler(dp_size=1)
    scheduler.follow_dp_group(*gloo_groups(1))

    def broken(*args, **kwargs):
        raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(dist, "all_gather", broken)
    with pytest.raises(RuntimeError):
        scheduler.balance_gather()
    assert scheduler.balance_gate.watchdog.started is None
    assert str(scheduler.balance_gate.watchdog.raised) == "Connection reset by peer"
