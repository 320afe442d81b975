"""``balance_collective: "recursive_doubling"`` decides the gate exactly as the contract's
all_gather, on real gloo groups (stateless, like vLLM's DP group; ranks as threads).

Two levels: the reduction alone against an all_gather of the same counts, and real balance
schedulers stepped side by side, one per collective on each rank, with their gate decisions,
``SchedulerOutput``s and statistics compared step by step. The negative control is
``late_fold_in_reduce`` (balance_testbed.variants): the same rounds with the extra ranks of a
non-power-of-two DP folded in after the doubling instead of before.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from test_contract import CAP, gloo_groups, run_as_ranks

import vllm_balance
from balance_testbed import factories
from balance_testbed.variants import late_fold_in_reduce
from vllm_balance.shim import collective

pytestmark = pytest.mark.path_independent

# Powers of two and not, up to two extra ranks folded in (5, 6) and three rounds (8).
DP_SIZES = (2, 3, 4, 5, 6, 8)


def all_gathered(groups, counts: list[int]) -> list[list[int]]:
    def gather(rank: int):
        def call():
            out = [torch.zeros(1, dtype=torch.int32) for _ in counts]
            mine = torch.tensor([counts[rank]], dtype=torch.int32)
            dist.all_gather(out, mine, group=groups[rank])
            return [int(t) for t in out]

        return call

    return run_as_ranks(*(gather(rank) for rank in range(len(counts))))


def reduced(reduce, groups, counts: list[int]) -> list[collective.Reduced]:
    return run_as_ranks(*(lambda r=r: reduce(counts[r], groups[r]) for r in range(len(counts))))


def assert_reduction_is_the_gathers(reduce, groups, counts: list[int]) -> None:
    """Every rank's reduction is (max, min, sum) of what the all_gather gives every rank."""
    gathered = all_gathered(groups, counts)
    assert gathered == [counts] * len(counts)
    expected = collective.Reduced(max(counts), min(counts), sum(counts))
    for rank, got in enumerate(reduced(reduce, groups, counts)):
        assert got == expected, (counts, rank, got)
        assert (got.maximum == CAP) == (max(gathered[rank]) == CAP)  # the gate


def count_vectors(dp: int) -> list[list[int]]:
    """At the cap on each rank in turn (the extra ranks included), above it, below it, zeros."""
    vectors = []
    for leader in range(dp):
        vectors.append([CAP if r == leader else r % CAP for r in range(dp)])
    rng = random.Random(dp)
    vectors += [[rng.randint(0, CAP + 2) for _ in range(dp)] for _ in range(6)]
    vectors += [[0] * dp, [CAP + 1] + [CAP] * (dp - 1)]
    return vectors


@pytest.mark.parametrize("dp", DP_SIZES)
def test_reduction_equals_the_all_gather_on_every_rank(dp):
    groups = gloo_groups(dp)
    for counts in count_vectors(dp):
        assert_reduction_is_the_gathers(collective.reduce_running, groups, counts)


def test_negative_control_late_fold_in_is_caught():
    """The wrong fold-in returns (no hang) with a different max on the ranks it skipped."""
    groups = gloo_groups(3)
    with pytest.raises(AssertionError, match=r"\[0, 1, 4\], 1"):
        assert_reduction_is_the_gathers(late_fold_in_reduce, groups, [0, 1, CAP])


# Real schedulers, stepped side by side: the engine's order per step is schedule, forward,
# update_from_output, then the gather (shim/engine_core.py); the next schedule() reads it.


def rank_scheduler(dp: int, collective_name: str, **additional):
    return factories.make_scheduler(
        vllm_balance.BalanceScheduler,
        data_parallel_size=dp,
        max_num_seqs=CAP,
        additional_config={
            "enable_balance_scheduling": True,
            "balance_collective": collective_name,
            **additional,
        },
    )


def workload(rank: int, dp: int, step: int) -> list:
    """The last rank (an extra rank where DP is not a power of two) fills past the cap early;
    the others get a few requests now and then, so the gate opens and closes."""
    if step == 0:
        n = 2 * CAP if rank == dp - 1 else rank % 3 + 1
    elif step % 7 == rank % 7:
        n = 2
    else:
        return []
    return factories.make_requests(n, start=1000 * step, max_tokens=3 + rank + step % 4)


def side_by_side(dp: int, steps: int = 40, **additional) -> list[list[tuple]]:
    """Per rank, per step: (gate all_gather, gate reduction, first SchedulerOutput difference)."""
    pairs = [
        (
            rank_scheduler(dp, "all_gather", **additional),
            rank_scheduler(dp, "recursive_doubling", **additional),
        )
        for _ in range(dp)
    ]
    gather_groups, reduce_groups = gloo_groups(dp), gloo_groups(dp)
    for rank, (gathering, reducing) in enumerate(pairs):
        gathering.follow_dp_group(gather_groups[rank])
        reducing.follow_dp_group(reduce_groups[rank])

    def run(rank: int):
        gathering, reducing = pairs[rank]
        rows = []
        for step in range(steps):
            for scheduler in (gathering, reducing):
                factories.add_requests(scheduler, workload(rank, dp, step))
            ours, _ = factories.step(gathering)
            theirs, _ = factories.step(reducing)
            difference = factories.first_difference(
                factories.describe(ours), factories.describe(theirs)
            )
            rows.append((gathering.balance_gate.frozen, reducing.balance_gate.frozen, difference))
            gathering.balance_gather()
            reducing.balance_gather()
        return rows

    return run_as_ranks(*(lambda r=r: run(r) for r in range(dp)))


def assert_same_decisions(rows_by_rank: list[list[tuple]]) -> int:
    """Identical gate and output on every rank at every step; returns the frozen steps seen."""
    frozen = 0
    for rank, rows in enumerate(rows_by_rank):
        for step, (gathered_gate, reduced_gate, difference) in enumerate(rows):
            assert gathered_gate == reduced_gate, (rank, step, gathered_gate, reduced_gate)
            assert difference is None, (rank, step, difference)
            frozen += gathered_gate
    return frozen


@pytest.mark.parametrize("dp", (2, 3, 4, 5))
def test_schedulers_decide_and_schedule_the_same_step_by_step(dp):
    assert assert_same_decisions(side_by_side(dp)) > 0  # the gate closed at some point


def test_bounded_hold_releases_the_same_steps_under_both_collectives():
    assert assert_same_decisions(side_by_side(3, balance_max_frozen_steps=2)) > 0


def test_negative_control_late_fold_in_changes_a_gate_decision(monkeypatch):
    monkeypatch.setattr(collective, "reduce_running", late_fold_in_reduce)
    # Rank 1 decided without rank 2 (at the cap): frozen under the all_gather, open here.
    with pytest.raises(AssertionError, match=r"^\(1, \d+, True, False\)"):
        assert_same_decisions(side_by_side(3))


def test_statistics_are_the_same_under_both_collectives():
    groups_a, groups_b = gloo_groups(3), gloo_groups(3)
    counts = [2, CAP, 1]
    pairs = [
        (rank_scheduler(3, "all_gather"), rank_scheduler(3, "recursive_doubling")) for _ in counts
    ]
    for rank, (gathering, reducing) in enumerate(pairs):
        gathering.follow_dp_group(groups_a[rank])
        reducing.follow_dp_group(groups_b[rank])
        for scheduler in (gathering, reducing):
            factories.add_requests(scheduler, factories.make_requests(counts[rank], max_tokens=50))
            factories.step(scheduler)

    def gather(rank: int):
        for scheduler in pairs[rank]:
            scheduler.balance_gather()

    run_as_ranks(*(lambda r=r: gather(r) for r in range(3)))
    for gathering, reducing in pairs:
        a, b = gathering.balance_gate.stats, reducing.balance_gate.stats
        fields = ("gathers", "gathered_max", "gathered_min", "gathered_mean", "largest_gap")
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        assert (a.gathered_max, a.gathered_min, a.last_gathered) == (CAP, 1, counts)
        assert b.last_gathered == []  # no per-rank counts: the watchdog says max and min instead
        assert reducing.balance_gate.leader == gathering.balance_gate.leader == CAP
        assert reducing.balance_gate.leader_at_cap() and gathering.balance_gate.leader_at_cap()
