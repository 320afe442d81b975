"""Elastic EP resize: the gather follows the DP group vLLM swaps in, scale up and down.

vLLM's ``ElasticEPScalingState`` replaces the engine core's DP group with one of the new size,
changes ``data_parallel_size`` in place and keeps the scheduler. A buffer kept at its start-up
size fails the next gather (gloo: ``invalid output tensor list``); under ``recursive_doubling``
the gate stays right but the mean divides by the old size and the watchdog names the old rank
count. Here vLLM's own states run in one process per rank on real gloo groups (``resize.py``),
and every step's gate is checked on both groups: before the resize, on the first step of the new
group (open, as after start-up: nothing gathered on it yet), and after its first gather.
The negative control is the mutant ``buffer_fixed_at_start_size`` (tests/mutation/).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multiproc.harness import join_ranks, rank_process_context

pytestmark = [pytest.mark.timeout(600), pytest.mark.path_independent]

# A rank stuck in a collective (a peer failed) is killed after this long.
RANK_SECONDS = 120.0


def run_ranks(specs: list[dict], tmp_path) -> list[dict]:
    """Run ``resize.rank_main`` for each spec in its own process; each rank's result."""
    from torch.distributed import TCPStore
    from vllm.utils.network_utils import get_open_port

    from tests.multiproc.resize import rank_main

    ports = {"start_port": get_open_port(), "new_port": get_open_port()}
    new_rank_port = get_open_port()  # a new rank starts on the new group's coord store
    coord_port = get_open_port()
    # vLLM's elastic-EP coordination store (the front end runs it): readiness keys and the
    # new group's port.
    store = TCPStore("127.0.0.1", coord_port, is_master=True, wait_for_workers=False)
    context = rank_process_context()
    procs = []
    for spec in specs:
        spec.update(ports, coord_port=coord_port, result_file=str(tmp_path / f"{spec['rank']}"))
        if spec["role"] == "new":
            spec["start_port"] = new_rank_port
        proc = context.Process(target=rank_main, args=(spec,), name=f"resize-{spec['rank']}")
        proc.start()
        procs.append(proc)
    join_ranks(procs, RANK_SECONDS, failed=lambda: any(_error(spec) for spec in specs))
    del store
    results = []
    for proc, spec in zip(procs, specs):
        path = tmp_path / f"{spec['rank']}"
        result = json.loads(path.read_text()) if path.exists() else {"error": "no result"}
        assert "error" not in result, (spec["rank"], result["error"], proc.exitcode)
        results.append(result["ok"])
    return results


def _error(spec: dict) -> bool:
    path = Path(spec["result_file"])
    return path.exists() and "error" in json.loads(path.read_text() or "{}")


def by_label(result: dict) -> dict[str, dict]:
    return {record["label"].split("-", 1)[1]: record for record in result["records"]}


@pytest.mark.parametrize("collective", ["all_gather", "recursive_doubling"])
def test_scale_down_the_gate_follows_the_smaller_group_from_the_next_step(tmp_path, collective):
    common = dict(old_size=3, new_size=2, start_size=3, collective=collective)
    specs = [
        dict(common, rank=0, role="existing", before=[0, 1], after=[0, 1]),
        dict(common, rank=1, role="existing", before=[0, 1], after=[1, 0]),
        dict(common, rank=2, role="removing", before=[2, 0], after=[]),
    ]
    results = run_ranks(specs, tmp_path)
    for rank, result in enumerate(results):
        steps = by_label(result)
        # Old group: rank 2 at the cap freezes every rank.
        assert steps["before-1"]["frozen"] and steps["before-1"]["admitted"] == 0, steps
        # The workers' part of vLLM's commit was asked for (on the device; stood in here).
        assert result["rpcs"] == [["elastic_ep_execute", "commit_scale_down"]], result["rpcs"]
        if rank == 2:
            continue
        expected_read = [0, 0] if collective == "all_gather" else [0]
        # First step on the new group: the removed leader no longer freezes anyone.
        assert steps["after-0"]["read"] == expected_read and not steps["after-0"]["frozen"], steps
        assert steps["after-0"]["admitted"] == (1, 2)[rank], steps
        # Its gather: rank 1 now at the cap freezes both remaining ranks on the next step.
        assert steps["after-1"]["frozen"] and steps["after-1"]["admitted"] == 0, steps
        assert steps["after-1"]["group"] == [rank, 2] and steps["after-1"]["watchdog"] == [rank, 2]
        assert steps["after-1"]["gathered_mean"] == pytest.approx(1.5), steps
        assert result["dp_size"] == 2 and result["frozen_streak"] == 2, result


@pytest.mark.parametrize("collective", ["all_gather", "recursive_doubling"])
def test_scale_up_the_gate_follows_the_larger_group_from_the_next_step(tmp_path, collective):
    common = dict(old_size=2, new_size=3, collective=collective)
    specs = [
        dict(common, rank=0, role="existing", start_size=2, before=[0, 1], after=[0, 1]),
        dict(common, rank=1, role="existing", start_size=2, before=[2, 0], after=[0, 0]),
        dict(common, rank=2, role="new", start_size=3, before=[], after=[2, 0]),
    ]
    results = run_ranks(specs, tmp_path)
    expected_read = [0, 0, 0] if collective == "all_gather" else [0]
    new_rank_steps = ["prepare_new_worker", "warmup_new_worker", "commit_scale_up"]
    worker_steps = [["commit_scale_up"], ["commit_scale_up"], new_rank_steps]
    for rank, result in enumerate(results):
        assert [call[1] for call in result["rpcs"]] == worker_steps[rank], result["rpcs"]
        steps = by_label(result)
        if rank < 2:  # old group: rank 1 at the cap freezes both
            assert steps["before-1"]["frozen"] and steps["before-1"]["admitted"] == 0, steps
        # First step on the new group: open on every rank, the new one included.
        assert steps["after-0"]["read"] == expected_read and not steps["after-0"]["frozen"], steps
        assert steps["after-0"]["admitted"] == (1, 0, 2)[rank], steps
        # Its gather holds the new rank's count: the cap freezes all three.
        assert steps["after-1"]["frozen"] and steps["after-1"]["admitted"] == 0, steps
        assert steps["after-1"]["group"] == [rank, 3] and steps["after-1"]["watchdog"] == [rank, 3]
        assert steps["after-1"]["gathered_mean"] == pytest.approx(5 / 3), steps
        assert result["dp_size"] == 3 and result["frozen_streak"] == 2, result
