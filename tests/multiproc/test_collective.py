"""``balance_collective: "recursive_doubling"`` in real engine-core processes (issue 17).

The fixed traces of test_deadlocks.py (which runs them with the default all_gather) at DP 2, 3
and 4, with the log-depth reduction at the shipped hook's place. Each rank also runs a shadow
all_gather of the same count right after each reduction (tests/multiproc/rank.py), so
``check_trace`` compares the two collectives at every step on every rank: the reduction equals
max/min/sum of the all_gather, and the gate decision each rank took is ``max(all_gather) == cap``.
The negative control runs the late fold-in reduction (variants.py) at DP=3 with the last rank,
the one folded in, at the cap: check_trace must catch the other ranks deciding without it.
"""

from __future__ import annotations

import pytest

from tests.multiproc.events import Add, Trace
from tests.multiproc.harness import Cluster
from tests.multiproc.invariants import check_trace
from tests.multiproc.traces import CAP, fixed_traces
from vllm_balance.config import COLLECTIVE_KEY, RECURSIVE_DOUBLING

pytestmark = pytest.mark.timeout(900)

REDUCE = {COLLECTIVE_KEY: RECURSIVE_DOUBLING}
DP_SIZES = (2, 3, 4)


@pytest.mark.parametrize("dp", DP_SIZES)
def test_reduction_decides_like_the_all_gather_on_every_trace(dp):
    frozen = {}
    cluster = Cluster(dp, mode="balance", additional_config=REDUCE)
    with cluster:
        for trace in fixed_traces(dp):
            summary = check_trace(cluster.run_trace(trace))
            assert summary.gathers > 0, trace.name
            frozen[trace.name] = summary.frozen_steps
    assert cluster.leftover_processes() == []
    assert frozen[f"saturate_cap-dp{dp}"] > 0, frozen  # the gate closed under the reduction


def saturate_last_rank(dp: int) -> Trace:
    """The last rank, the one folded in where DP is not a power of two, is held at the cap."""
    events = [Add(dp - 1, f"last-{i}", 8, 6 + i) for i in range(2 * CAP)]
    events += [Add(r, f"other-{r}", 8, 12) for r in range(dp - 1)]
    return Trace(f"saturate_last_rank-dp{dp}", dp, events)


def test_negative_control_late_fold_in_is_caught():
    cluster = Cluster(
        3, mode="balance", additional_config=REDUCE, extra_env={"VBH_REDUCE": "late_fold_in"}
    )
    with cluster:
        result = cluster.run_trace(saturate_last_rank(3))
    with pytest.raises(AssertionError, match="differs|reduction"):
        check_trace(result)
