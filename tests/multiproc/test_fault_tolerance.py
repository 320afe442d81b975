"""vLLM's fault tolerance with balance on: a peer's fault becomes each healthy rank's own fault.

Two ranks in real processes on a real gloo DP group, each running its busy loop under vLLM's own
``fault_tolerant_wrapper`` and ``EngineCoreSentinel`` (``fault_tolerance.py`` says which parts
are vLLM's and which the test drives). A faulted peer never enters the step's gather; with fault
tolerance on the gather fails after its timeout (here half of ``engine_recovery_timeout_sec``,
``gather_timeout_under_fault_tolerance``), the ``RuntimeError`` leaves the busy loop into the
wrapper, ``on_fault`` aborts the rank's requests and reports it UNHEALTHY, and ``retry`` (sent to
every rank once every rank is UNHEALTHY) rebuilds the DP group. The first step on the rebuilt group
is open, as after start-up: the counts gathered before the fault (a leader at the cap) must not
freeze it.

Negative controls: the gather without its timeout (the healthy rank waits until the faulted one
gives up and exits: later than the bound, and never UNHEALTHY in time for ``retry``); a buffer kept
across the group's re-init (the first step after ``retry`` frozen on the stale counts).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.multiproc.fault_tolerance import CAP
from tests.multiproc.harness import join_ranks, rank_process_context
from vllm_balance.shim.watchdog import FAILED

# Not path_independent: what the seam changes is not at stake here, but vLLM's fault tolerance
# differs by release (0.34 reworked retry and added the DIAGNOSING status), and 0.33 has only a
# seam session.
pytestmark = [pytest.mark.timeout(400)]

RECOVERY_S = 8  # engine_recovery_timeout_sec: a faulted rank waits this long for retry
GATHER_TIMEOUT_S = RECOVERY_S / 2  # what balance derives from it (cpu timeout unset)
WARN_S = 1.0  # the watchdog reports the blocked gather before it fails
# Allowance on a loaded 2-core machine between the peer's fault and the healthy rank's on_fault,
# beyond the timeout: well under RECOVERY_S - GATHER_TIMEOUT_S, when only the faulted rank's exit
# (after RECOVERY_S) would release it.
SLACK_S = 2.0
# Bounds a hang only (the test ends when every rank has): the harness's forkserver imports vLLM
# before its first rank starts, minutes on a loaded machine.
RANK_SECONDS = 240.0


def run_ranks(tmp_path, rounds: list[list[list[dict]]], retries: int, **options) -> list[dict]:
    """Run ``fault_tolerance.rank_main`` per rank (``rounds[rank]``: that rank's steps, round by
    round); each rank's result, None for a rank that killed itself."""
    from torch.distributed import TCPStore
    from vllm.utils.network_utils import get_open_port

    from tests.multiproc.fault_tolerance import rank_main

    store_port, port = get_open_port(), get_open_port()
    store = TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    context = rank_process_context()
    specs, procs = [], []
    for rank, rank_rounds in enumerate(rounds):
        spec = dict(
            rank=rank,
            dp_size=len(rounds),
            port=port,
            store_port=store_port,
            collective=options.get("collective", "all_gather"),
            recovery_s=options.get("recovery_s", RECOVERY_S),
            warn_s=WARN_S,
            rounds=rank_rounds,
            retries=retries,
            result_file=str(tmp_path / f"result-{rank}.json"),
            log_file=str(tmp_path / f"rank-{rank}.log"),
        )
        proc = context.Process(target=rank_main, args=(spec,), name=f"ft-{rank}")
        proc.start()
        specs.append(spec)
        procs.append(proc)
    join_ranks(procs, RANK_SECONDS)
    del store
    results = []
    for spec, proc in zip(specs, procs):
        path = tmp_path / f"result-{spec['rank']}.json"
        if not path.exists():
            results.append(None)
            continue
        result = json.loads(path.read_text())
        assert "error" not in result, (spec["rank"], result.get("traceback"), proc.exitcode)
        result["ok"]["log"] = (tmp_path / f"rank-{spec['rank']}.log").read_text(errors="replace")
        results.append(result["ok"])
    return results


def steps(*adds: int, fault_at: int | None = None, fault: str = "raise") -> list[dict]:
    """One round of a rank: the requests it adds at each step, and its fault (if any)."""
    return [{"adds": n, **({"fault": fault} if i == fault_at else {})} for i, n in enumerate(adds)]


def released_after(healthy: dict, faulted: dict, fault_round: int) -> float:
    """Seconds from the peer's fault to the healthy rank's own, in that round."""
    [fault] = [f for f in healthy["faults"] if f["round"] == fault_round]
    [injected] = [
        at for round_index, at in faulted["fault_injected_at"] if round_index == fault_round
    ]
    return fault["at"] - injected


def assert_released_by_the_gather_timeout(healthy: dict, faulted: dict, fault_round: int):
    """The healthy rank's fault: its balance gather timed out, within the bound, into on_fault."""
    [fault] = [f for f in healthy["faults"] if f["round"] == fault_round]
    assert fault["in_gather"] and fault["type"] == "RuntimeError", fault
    assert "Timed out" in fault["message"], fault
    waited = released_after(healthy, faulted, fault_round)
    assert waited <= GATHER_TIMEOUT_S + SLACK_S, (waited, fault)
    return waited


def assert_no_request_lost(result: dict) -> None:
    """Every request added is aborted to its client (on_fault) or still in the scheduler."""
    lost = set(result["added"]) - set(result["aborted"]) - set(result["in_scheduler"])
    assert lost == set(), lost


def assert_first_step_after_retry_open(result: dict, round_index: int, dp: int = 2) -> dict:
    """The first step on the rebuilt group reads zeros, so a stale leader at the cap freezes
    nothing; its gather then reads the new group's counts."""
    first = next(s for s in result["steps"] if f"-round{round_index}-0" in s["label"])
    assert first["read"] in ([0] * dp, [0]) and not first["frozen"], first
    assert first["admitted"] >= 1, first
    return first


def assert_recovered(result: dict, rounds: int) -> None:
    assert [r["success"] for r in result["retries"]] == [True] * rounds, result["retries"]
    assert result["ended"] == "SystemExit" and result["status"] == "HEALTHY", result["ended"]
    assert_no_request_lost(result)


@pytest.mark.parametrize("collective", ["all_gather", "recursive_doubling"])
def test_peer_fault_releases_the_healthy_rank_into_vllms_recovery(tmp_path, collective):
    # Rank 0 reaches the cap; rank 1 faults on round 0's step 3 (after vLLM's step-1 DP sync).
    healthy, faulted = run_ranks(
        tmp_path,
        [
            [steps(1, 1, 0, 0), steps(1, 0, 0)],
            [steps(1, 0, 0, 0, fault_at=3), steps(1, 0, 0)],
        ],
        retries=1,
        collective=collective,
    )
    waited = assert_released_by_the_gather_timeout(healthy, faulted, 0)
    assert waited >= GATHER_TIMEOUT_S - 0.5, waited  # the timeout released it, nothing sooner
    assert healthy["faults"][0]["running"] == CAP  # the leader at the cap, aborted by on_fault
    for result in (healthy, faulted):
        assert_recovered(result, rounds=1)
        [fault] = result["faults"]
        assert fault["round"] == 0
        first = assert_first_step_after_retry_open(result, 1)
        assert first["group"] != result["steps"][0]["group"]  # retry's new DP group
        assert result["steps"][-1]["gathered"] in ([1, 1], [1]), result["steps"][-1]
    # The watchdog reported the gather blocked, then how it ended.
    assert f"{FAILED}: DP0 gather #4 raised after" in healthy["log"], healthy["log"][-3000:]
    assert (
        "fault tolerance: gather timeout 4 s (half of engine_recovery_timeout_sec=8)"
        in (healthy["log"])
    )


def test_leader_at_the_cap_faulting_leaves_the_first_step_after_retry_open(tmp_path):
    # Rank 1 is the leader at the cap when it faults: rank 0's last gathered counts are [1, 2].
    healthy, faulted = run_ranks(
        tmp_path,
        [
            [steps(1, 0, 0, 0), steps(1, 1, 0)],
            [steps(1, 1, 0, 0, fault_at=3), steps(0, 0, 0)],
        ],
        retries=1,
    )
    assert_released_by_the_gather_timeout(healthy, faulted, 0)
    before_fault = [s for s in healthy["steps"] if "-round0-" in s["label"]]
    assert before_fault[-1]["read"] == [1, CAP] and before_fault[-1]["frozen"], before_fault
    assert faulted["faults"][0]["running"] == CAP
    for result in (healthy, faulted):
        assert_recovered(result, rounds=1)
    # Stale counts would freeze rank 0's first step (max == cap); fresh ones admit.
    assert assert_first_step_after_retry_open(healthy, 1)["admitted"] == 1
    assert healthy["steps"][-1]["gathered"] == [CAP, 0], healthy["steps"][-1]


def test_two_faults_in_a_row_each_recover_on_a_new_group(tmp_path):
    # Round 0: rank 1 faults. Round 1 (after retry): rank 1 reaches the cap, rank 0 faults.
    first_faulted, second_faulted = run_ranks(
        tmp_path,
        [
            [steps(1, 0, 0, 0), steps(1, 0, 0, 0, fault_at=3), steps(1, 0)],
            [steps(1, 0, 0, 0, fault_at=3), steps(1, 1, 0, 0), steps(1, 0)],
        ],
        retries=2,
    )
    rank0, rank1 = first_faulted, second_faulted
    assert_released_by_the_gather_timeout(rank0, rank1, 0)
    assert_released_by_the_gather_timeout(rank1, rank0, 1)
    for result in (rank0, rank1):
        assert_recovered(result, rounds=2)
        assert [f["round"] for f in result["faults"]] == [0, 1]
        groups = [
            next(s for s in result["steps"] if f"-round{r}-0" in s["label"])["group"]
            for r in range(3)
        ]
        assert len(set(groups)) == 3, groups  # a new DP group after each retry
        assert_first_step_after_retry_open(result, 1)
        assert_first_step_after_retry_open(result, 2)
    # Before the second fault rank 1 was the leader at the cap: rank 0 read it, frozen.
    round1 = [s for s in rank0["steps"] if "-round1-" in s["label"]]
    assert round1[-1]["read"] == [1, CAP] and round1[-1]["frozen"], round1


def test_killed_peer_releases_the_healthy_rank_at_once_into_on_fault(tmp_path):
    recovery_s = 4  # its gather timeout: 2 s
    healthy, killed = run_ranks(
        tmp_path,
        [[steps(1, 0, 0, 0)], [steps(1, 0, 0, 0, fault_at=3, fault="kill")]],
        retries=1,
        recovery_s=recovery_s,
    )
    assert killed is None  # it died mid-step
    [fault] = healthy["faults"]
    assert fault["in_gather"] and fault["type"] == "RuntimeError", fault
    [waited] = re.findall(rf"{FAILED}: DP0 gather #4 raised after ([\d.]+) s", healthy["log"])
    assert float(waited) < recovery_s / 4, waited  # well inside the timeout: not what released it
    # Released by the closed connection, before any timeout; then UNHEALTHY, waiting for a
    # retry that cannot come (vLLM's scale_down would drop the dead rank), until the wrapper
    # gives up after engine_recovery_timeout_sec and re-raises.
    assert "unhealthy" in [status for _, status in healthy["statuses"]], healthy["statuses"]
    assert healthy["retries"] == [] and healthy["ended"].startswith("RuntimeError"), healthy
    assert_no_request_lost(healthy)
    assert healthy["aborted"] == [healthy["added"][0]]
