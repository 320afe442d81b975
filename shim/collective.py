"""The opt-in log-depth collective (``balance_collective: "recursive_doubling"``).

The gate needs only the largest running count (``BalanceGate.leader == cap``), and the stats the
smallest and the sum. gloo's ``all_gather`` is a ring of DP-1 sequential hops, and its
``all_reduce`` a ring of 2(DP-1) (docs/scaling.md cites the source); recursive doubling reduces
``[running, -running, running]`` (elementwise max, max, sum) in ceil(log2 DP) rounds of pairwise
exchange: round k pairs rank r with ``r ^ 2**k``. A DP size that is not a power of two first
folds each extra rank ``r >= 2**floor(log2 DP)`` into rank ``r - 2**floor(log2 DP)``, and that
rank hands the result back at the end: two more hops. The largest count is reduced itself, not
an at-cap flag, so ``max == cap`` is the contract's decision by construction, also where a rank's
count differs from the cap in either direction.

Point-to-point on the ProcessGroup object itself: vLLM's DP group is a stateless gloo group that
``torch.distributed`` does not know (its ``send``/``recv`` with ``group=`` translate ranks through
the default group's registry), while ``ProcessGroup.send``/``recv`` take group ranks. Their gloo
slot is the tag alone, apart from the slots gloo's collectives build from a prefix, so these
messages cannot be mistaken for the engine's own all_reduce on the same group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, NamedTuple

import torch

# ``Work.wait``'s own default: wait as long as the group's timeout allows.
NO_TIMEOUT = timedelta(0)


class Reduced(NamedTuple):
    """What the reduction returns on every rank: the largest, smallest and summed counts."""

    maximum: int
    minimum: int
    total: int


def _send(group: Any, tensor: torch.Tensor, peer: int, tag: int) -> Any:
    return group.send([tensor], peer, tag)


def _recv(
    group: Any, peer: int, tag: int, like: torch.Tensor, timeout: timedelta = NO_TIMEOUT
) -> torch.Tensor:
    received = torch.empty_like(like)
    group.recv([received], peer, tag).wait(timeout)
    return received


def combine(mine: torch.Tensor, theirs: torch.Tensor) -> None:
    """``mine`` := max of the first two entries, sum of the third (in place)."""
    torch.maximum(mine[:2], theirs[:2], out=mine[:2])
    mine[2] += theirs[2]


def fold_size(world: int) -> int:
    """The largest power of two <= ``world``: the ranks that take part in the doubling."""
    return 1 << (world.bit_length() - 1)


def initial(running: int) -> torch.Tensor:
    """One rank's contribution: ``[running, -running, running]`` (max, -min, sum)."""
    return torch.tensor([running, -running, running], dtype=torch.int64)


def result(values: torch.Tensor) -> Reduced:
    return Reduced(int(values[0]), -int(values[1]), int(values[2]))


def double(
    values: torch.Tensor, group: Any, rank: int, core: int, timeout: timedelta = NO_TIMEOUT
) -> None:
    """The log2(core) rounds among ranks ``0..core-1``: round k exchanges with ``rank ^ 2**k``."""
    mask = 1
    while mask < core:
        peer = rank ^ mask
        outgoing = values.clone()  # unchanged while the send is in flight
        sent = _send(group, outgoing, peer, tag=mask)
        combine(values, _recv(group, peer, tag=mask, like=values, timeout=timeout))
        sent.wait(timeout)
        mask <<= 1


def reduce_running(running: int, group: Any, timeout: timedelta = NO_TIMEOUT) -> Reduced:
    """Max, min and sum of every rank's ``running`` over ``group`` in ceil(log2 size) hops.

    Every rank of ``group`` must call it once, at the same point (like any collective; for the
    engine that is ``balance_gather()``'s placement). ``timeout`` bounds each message's wait
    (``RuntimeError`` from gloo past it), as vLLM's ``cpu_all_reduce_`` bounds its own.
    """
    rank, world = group.rank(), group.size()
    values = initial(running)
    core = fold_size(world)
    if rank >= core:  # an extra rank: contribute to the partner, wait for the result
        _send(group, values, rank - core, tag=0).wait(timeout)
        return result(_recv(group, rank - core, tag=0, like=values, timeout=timeout))
    extra = rank + core if rank + core < world else None
    if extra is not None:  # fold the extra rank in before the doubling, so every rank sees it
        combine(values, _recv(group, extra, tag=0, like=values, timeout=timeout))
    double(values, group, rank, core, timeout)
    if extra is not None:
        _send(group, values, extra, tag=0).wait(timeout)
    return result(values)
