"""The package runs on a seamed vLLM with ``compat/`` deleted (docs/design.md, "Deleting compat/").

The installed tree is copied without ``compat/`` and imported in a fresh interpreter in which
``vllm_balance.compat`` cannot be imported at all; there the plugin registers, the activation
selects the shim's scheduler for a real DP=2 config, and the gate holds admission while a rank is
at the cap and admits once none is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import session_has_seam

from vllm_balance import selection
from vllm_balance.selection import has_seam

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["vllm_balance.compat"] = None  # import vllm_balance.compat -> ImportError
    import torch
    from balance_testbed import factories
    import vllm_balance
    from vllm_balance import activation, plugin
    from vllm_balance.shim.scheduler import BalanceScheduler

    assert vllm_balance.__file__.startswith(sys.argv[1]), vllm_balance.__file__
    plugin.register()
    config = factories.make_vllm_config(
        data_parallel_size=2, max_num_seqs=2, additional_config={"enable_balance_scheduling": True}
    )
    assert activation.activate_for(config)
    cls = config.scheduler_config.scheduler_cls
    assert issubclass(cls, BalanceScheduler), cls
    scheduler = factories.make_scheduler(cls, vllm_config=config)
    factories.add_requests(scheduler, factories.make_requests(3))
    admitted = []
    for counts in ((2, 0), (1, 0)):
        scheduler.balance_gate.set_gathered(counts)
        output, _ = factories.step(scheduler)
        admitted.append(len(output.scheduled_new_reqs))
    assert admitted == [0, 2], admitted
    loaded = sorted(m for m, v in sys.modules.items() if m.startswith("vllm_balance") and v)
    print("OK", cls.__name__, loaded)
    """
)


def copy_without_compat(target: Path) -> Path:
    """The installed layout (vllm_balance/ with shim/ inside it), compat/ left out."""
    ignored = shutil.ignore_patterns("__pycache__", "compat")
    shutil.copytree(ROOT / "vllm_balance", target / "vllm_balance", ignore=ignored)
    return target


@pytest.mark.skipif(session_has_seam() is False, reason="needs a vLLM with the seam")
def test_package_runs_on_a_seamed_vllm_with_compat_deleted(tmp_path):
    if not has_seam():
        pytest.skip("the installed vLLM lacks the seam")
    tree = copy_without_compat(tmp_path / "site")
    assert not (tree / "vllm_balance" / "compat").exists()
    path = os.pathsep.join([str(tree), str(ROOT / "tests")])
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree)],
        env={**os.environ, "PYTHONPATH": path},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and "OK BalanceScheduler" in result.stdout, result.stderr[-3000:]
    assert "vllm_balance.compat" not in result.stdout


def test_without_the_seam_a_deleted_fallback_is_one_clear_error(monkeypatch):
    """The delete-day edit in selection (PHASE_2A_FALLBACK = None) on a vLLM without the seam
    whose schedule() the derived copy serves (a one-step PAUSED_NEW is not the hold there)."""
    if has_seam():
        pytest.skip("the installed vLLM has the seam: the fallback is never consulted")
    from vllm_balance.compat import pause_state

    monkeypatch.setattr(selection, "PHASE_2A_FALLBACK", None)
    monkeypatch.setattr(pause_state, "hold_for_installed_vllm", lambda: pause_state.DERIVED_COPY)
    selection.active_path.cache_clear()
    selection.balance_scheduler_classes.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="needs Scheduler._should_stop_admitting_waiting"):
            selection.balance_scheduler_classes()
    finally:
        selection.active_path.cache_clear()
        selection.balance_scheduler_classes.cache_clear()
