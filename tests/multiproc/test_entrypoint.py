"""Stretch: the full engine through vLLM's own launcher, with the package's plugin installed.

``tests/multiproc/entrypoint.py`` creates vLLM's async DP client (as ``AsyncLLM`` does), which
starts vLLM's ``DPCoordinator`` and one engine process per rank with target
``EngineCoreProc.run_engine_core`` (our wrapper). The only stand-in is the executor class. The
test asks each engine process what activation did there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.multiproc.harness import ROOT

pytestmark = pytest.mark.timeout(900)


def test_real_launcher_activates_balance_in_engine_processes():
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    run = subprocess.run(
        [sys.executable, "-m", "tests.multiproc.entrypoint", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [x for x in run.stdout.splitlines() if x.startswith("ENTRYPOINT-RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("ENTRYPOINT-RESULT "))
    assert result["tokens"] == result["expected"]
    assert sorted(result["finished"]) == sorted(result["expected"])
    assert [facts["dp_rank"] for facts in result["facts"]] == [0, 1]
    for facts in result["facts"]:
        # In the process vLLM created: wrapper present, module name swapped, balance classes built.
        assert facts["run_engine_core_wrapped"], facts
        assert facts["module_dp_engine_core"] == "BalanceDPEngineCoreProc", facts
        assert facts["engine_core_cls"] == "BalanceDPEngineCoreProc", facts
        assert "Balance" in facts["scheduler_cls"], facts
        assert facts["scheduler_has_dp_group"], facts  # injected by the engine core's hook
        assert facts["balance_dp_size"] == 2, facts  # sized for both ranks (from the constructor)
        # The gathers happened: every rank gathers once per active step, and the longest request
        # (one token per step) kept the ranks stepping for at least its max_tokens steps.
        assert (facts["balance_gathers"] or 0) >= max(result["expected"].values()), facts
