"""DP deployment shapes balance refuses at start-up (docs/operations.md, "DP deployment shapes").

The shapes it follows are tested where they run: elastic EP in ``multiproc/test_resize.py``,
pause and sleep in ``multiproc/test_pause.py``.
"""

from __future__ import annotations

import pytest
import vllm.v1.engine.core as core_module
from vllm.config import ParallelConfig
from vllm.v1.engine.core import DPEngineCoreProc

from balance_testbed import factories
from vllm_balance import activation, registry
from vllm_balance.shim.engine_core import BalanceDPEngineCoreProc

FAULT_TOLERANCE = "enable_fault_tolerance"


@pytest.fixture(autouse=True)
def restore_patches():
    yield
    registry.uninstall_all()
    assert core_module.DPEngineCoreProc is DPEngineCoreProc


def dp_moe_config(**parallel):
    config = factories.make_vllm_config(
        moe=True, data_parallel_size=2, additional_config={"enable_balance_scheduling": True}
    )
    for name, value in parallel.items():
        setattr(config.parallel_config, name, value)
    return config


needs_fault_tolerance = pytest.mark.skipif(
    FAULT_TOLERANCE not in ParallelConfig.__dataclass_fields__,
    reason="this vLLM has no fault tolerance (enable_fault_tolerance)",
)


@needs_fault_tolerance
def test_fault_tolerance_is_refused_at_start_up_naming_both_switches():
    with pytest.raises(activation.BalanceConfigError) as excinfo:
        activation.activate_for(dp_moe_config(enable_fault_tolerance=True))
    assert str(excinfo.value) == (
        "balance scheduling cannot run with vLLM's fault tolerance (--enable-fault-tolerance): "
        "after a rank's fault the healthy ranks would wait in balance's per-step gather instead "
        "of reaching vLLM's recovery; turn off one of enable_balance_scheduling and "
        "--enable-fault-tolerance"
    )
    assert core_module.DPEngineCoreProc is DPEngineCoreProc  # nothing installed


@needs_fault_tolerance
def test_fault_tolerance_off_activates_balance():
    assert activation.activate_for(dp_moe_config(enable_fault_tolerance=False)) is True
    assert core_module.DPEngineCoreProc is BalanceDPEngineCoreProc


@needs_fault_tolerance
def test_fault_tolerance_without_balance_is_not_touched():
    config = dp_moe_config(enable_fault_tolerance=True)
    config.additional_config["enable_balance_scheduling"] = False
    assert activation.activate_for(config) is False
    assert core_module.DPEngineCoreProc is DPEngineCoreProc
