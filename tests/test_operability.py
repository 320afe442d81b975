"""Operability: tuning keys, counters, the periodic log line, the opt-in bounded hold, and the
NPU-relevant guarantee that balance stays on the host (CPU tensors, gloo, no device sync)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_contract import (
    CAP,
    admitted,
    balance_scheduler,
    gloo_groups,
    run_as_ranks,
    with_waiting,
)
from vllm.v1.request import RequestStatus

import vllm_balance
from balance_testbed import factories
from vllm_balance.config import balance_options
from vllm_balance.log import LOGGER_NAME


def options_of(additional_config):
    return balance_options(factories.make_vllm_config(additional_config=additional_config))


# Tuning keys


def test_default_options_are_the_contract_with_a_ten_second_log_line():
    options = options_of({})
    assert options.max_frozen_steps is None and options.log_interval_s == 10.0


def test_gather_watchdog_warns_after_five_seconds_by_default_zero_turns_it_off():
    assert options_of({}).gather_warn_s == 5.0
    assert options_of({"balance_gather_warn_s": 0}).gather_warn_s is None
    nested = {"balance_gather_warn_s": 9, "scheduler_config": {"balance_gather_warn_s": 0.5}}
    assert options_of(nested).gather_warn_s == 0.5


def test_collective_is_the_contracts_all_gather_unless_recursive_doubling_is_asked_for():
    assert options_of({}).collective == "all_gather"
    assert options_of({"balance_collective": "recursive_doubling"}).collective == (
        "recursive_doubling"
    )


def test_log_line_is_turned_off_with_zero_and_nested_key_wins():
    assert options_of({"balance_log_interval_s": 0}).log_interval_s is None
    nested = {"balance_log_interval_s": 5, "scheduler_config": {"balance_log_interval_s": 2.5}}
    assert options_of(nested).log_interval_s == 2.5


NEED_BOUND = "must be an integer >= 1 (or unset for no bound)"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("balance_collective", "ring", "must be one of all_gather, recursive_doubling"),
        ("balance_collective", True, "must be one of all_gather, recursive_doubling"),
        ("balance_log_interval_s", "10", "must be a number of seconds >= 0"),
        ("balance_log_interval_s", -1, "must be a number of seconds >= 0"),
        ("balance_log_interval_s", float("nan"), "must be a number of seconds >= 0"),
        (
            "balance_gather_warn_s",
            "5",
            "must be a number of seconds >= 0 (0 turns the gather watchdog off), got '5'",
        ),
        ("balance_gather_warn_s", -0.5, "must be a number of seconds >= 0"),
        ("balance_gather_warn_s", float("inf"), "must be a number of seconds >= 0"),
        ("balance_gather_warn_s", True, "must be a number of seconds >= 0"),
        ("balance_max_frozen_steps", 0, "must be an integer >= 1 (or unset for no bound), got 0"),
        (
            "balance_max_frozen_steps",
            2.5,
            "must be an integer >= 1 (or unset for no bound), got 2.5",
        ),
        (
            "balance_max_frozen_steps",
            True,
            "must be an integer >= 1 (or unset for no bound), got True",
        ),
    ],
)
def test_bad_tuning_values_are_clear_errors_naming_the_key(key, value, message):
    from vllm_balance.config import BalanceConfigError

    with pytest.raises(BalanceConfigError) as excinfo:
        options_of({key: value})
    line = str(excinfo.value)
    assert line.startswith(f"additional_config.{key} {message}") and "\n" not in line
    assert line.endswith('see docs/operations.md, "Configuration keys"')


# Counters and the log line


def test_counters_follow_the_gate_and_the_gathered_vector():
    scheduler = with_waiting(balance_scheduler())
    for counts in ([0, CAP], [1, CAP], [2, 0]):
        scheduler.balance_gate.set_gathered(counts)
        scheduler.schedule()
    stats = scheduler.balance_gate.stats
    assert (stats.steps, stats.frozen_steps, stats.gathers) == (3, 2, 3)
    assert stats.deferred_admissions == 6 + 6  # six waiting on each frozen step
    assert (stats.gathered_max, stats.gathered_min, stats.gathered_mean) == (2, 0, 1.0)
    assert stats.largest_gap == CAP


def test_periodic_log_line_per_rank(caplog):
    scheduler = with_waiting(balance_scheduler())
    scheduler.balance_gate._periodic_log.interval_s = 1e-9
    scheduler.balance_gate._periodic_log._next = 0.0
    scheduler.balance_gate.set_gathered([0, CAP])
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        scheduler.schedule()
    assert "Balance DP0: steps=1, frozen=100.0%, deferred admissions=6, released=0" in caplog.text


def test_log_line_off_logs_nothing(caplog):
    scheduler = factories.make_scheduler(
        vllm_balance.BalanceScheduler,
        data_parallel_size=2,
        max_num_seqs=CAP,
        additional_config={"enable_balance_scheduling": True, "balance_log_interval_s": 0},
    )
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        for _ in range(3):
            scheduler.schedule()
    assert "Balance DP" not in caplog.text


# Opt-in bounded hold


def bounded_scheduler(max_frozen_steps: int):
    return with_waiting(
        factories.make_scheduler(
            vllm_balance.BalanceScheduler,
            data_parallel_size=2,
            max_num_seqs=CAP,
            additional_config={
                "enable_balance_scheduling": True,
                "balance_max_frozen_steps": max_frozen_steps,
            },
        ),
        n=12,
    )


def admits(scheduler) -> bool:
    """Schedule one step; abort what was admitted so this rank's own cap never interferes."""
    new = admitted(scheduler.schedule())
    scheduler.finish_requests(new, RequestStatus.FINISHED_ABORTED)
    return bool(new)


def test_bounded_hold_opens_one_step_after_n_frozen_steps():
    scheduler = bounded_scheduler(2)
    decisions = []
    for _ in range(7):
        scheduler.balance_gate.set_gathered([0, CAP])  # the leader never drains in this script
        decisions.append("admit" if admits(scheduler) else "frozen")
    assert decisions == ["frozen", "frozen", "admit", "frozen", "frozen", "admit", "frozen"]
    assert scheduler.balance_gate.stats.released_steps == 2


def test_bounded_hold_decision_is_identical_on_ranks_that_skip_schedule():
    # A drained rank runs dummy batches and never enters schedule(); it still gathers.
    busy, drained = bounded_scheduler(1), bounded_scheduler(1)
    busy_decisions, drained_decisions = [], []
    for step in range(4):
        for scheduler in (busy, drained):
            scheduler.balance_gate.set_gathered([CAP, 0])
        busy_decisions.append(admits(busy))
        if step == 3:  # the drained rank gets work only now
            drained_decisions.append(admits(drained))
    assert busy_decisions == [False, True, False, True]
    assert drained_decisions == [busy_decisions[3]]


def test_unset_bound_is_exactly_the_contract():
    scheduler = with_waiting(balance_scheduler(), n=12)
    for _ in range(6):
        scheduler.balance_gate.set_gathered([0, CAP])
        assert admitted(scheduler.schedule()) == []


# Host-only: the balance path creates CPU tensors, uses gloo, and never synchronizes a device


def test_balance_tensors_are_cpu_on_gloo_and_no_device_sync(monkeypatch):
    """What a CPU-only torch can catch: a device sync (trapped below) and an explicit non-CPU
    tensor (it raises here), both inside the ranks' gathers, which must also complete and deliver
    the counts. A tensor put on "the current device" is CPU here by construction; that case needs
    torch_npu imported, which the ``ascend`` session does (tests/conftest.py, REQUIRE_NPU)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("balance path synchronized a device")

    for module in (torch.cuda, getattr(torch, "accelerator", None), getattr(torch, "npu", None)):
        if module is not None and hasattr(module, "synchronize"):
            monkeypatch.setattr(module, "synchronize", forbidden)
    created = []
    real_tensor, real_zeros = torch.tensor, torch.zeros

    def recording(factory):
        def create(*args, **kwargs):
            created.append(factory(*args, **kwargs))
            return created[-1]

        return create

    monkeypatch.setattr(torch, "tensor", recording(real_tensor))
    monkeypatch.setattr(torch, "zeros", recording(real_zeros))

    ranks = [with_waiting(balance_scheduler()) for _ in range(2)]
    groups = gloo_groups(2)
    for scheduler, group in zip(ranks, groups):
        scheduler.follow_dp_group(group)
        assert group.name() == "gloo"  # stateless groups are not in the world map
    gathered = []
    for _ in range(2):
        run_as_ranks(*(s.balance_gather for s in ranks))
        gathered.append([s.balance_gate.stats.last_gathered for s in ranks])
        for scheduler in ranks:
            factories.step(scheduler)
    # Every rank received every rank's len(running): none before the first step, CAP after it.
    assert gathered == [[[0, 0], [0, 0]], [[CAP, CAP], [CAP, CAP]]]
    assert created and all(t.device.type == "cpu" for t in created)
