"""Soak: randomized traces across DP 2..4 through the real DP busy loop (``nox -s soak``).

    VLLM_BALANCE_SOAK_TRACES=200 python -m pytest -m slow tests/multiproc/test_soak.py

Traces are spread evenly over DP 2, 3 and 4 and run on one long-lived cluster per DP size;
each trace passes every per-run invariant of ``harness.check_trace``. Seeds are fixed
(``VLLM_BALANCE_SOAK_SEED``), so a failing trace is reproduced by its name.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.multiproc.harness import Cluster
from tests.multiproc.invariants import check_trace
from tests.multiproc.traces import DP_SIZES, soak_traces

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

TRACES = int(os.environ.get("VLLM_BALANCE_SOAK_TRACES", "201"))
SEED = int(os.environ.get("VLLM_BALANCE_SOAK_SEED", "0"))


@pytest.mark.parametrize("dp", DP_SIZES)
def test_soak_random_traces_complete(dp):
    traces = [trace for trace in soak_traces(TRACES, SEED) if trace.dp_size == dp]
    started = time.monotonic()
    frozen_steps = gathers = 0
    with Cluster(dp, mode="balance") as cluster:
        for trace in traces:
            summary = check_trace(cluster.run_trace(trace))
            frozen_steps += summary.frozen_steps
            gathers += summary.gathers
    assert cluster.leftover_processes() == []
    print(
        f"\nsoak dp={dp}: {len(traces)} traces, 0 hangs, {gathers} gathers, "
        f"{frozen_steps} frozen-gate steps, {time.monotonic() - started:.1f} s"
    )
    assert frozen_steps > 0, "the random traces never drove the gate closed"
