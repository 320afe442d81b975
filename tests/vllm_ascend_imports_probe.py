"""Copied into a vllm-ascend tree as a test file by tests/test_vllm_ascend_series.py; run there.

vllm-ascend's pause-state PR imports nothing of vllm-balance-scheduling: after vllm-ascend's own
config init (balance on) and a frozen step of its ``BalanceScheduler``, no module of this
repository (``vllm_balance``, ``balance_testbed``, ``balance_sim``) is loaded, although this
package is installed in the environment the probe runs in.
"""

import sys
from types import SimpleNamespace
from unittest.mock import patch

from tests.ut.patch.platform.test_patch_balance_schedule import (
    _create_requests,
    _frozen_by_balance,
    _make_balance_scheduler,
)

OURS = ("vllm_balance", "balance_testbed", "balance_sim")


def ours_loaded() -> list[str]:
    return sorted(name for name in sys.modules if name.split(".")[0] in OURS)


def test_nothing_of_this_package_after_config_init_and_a_frozen_step():
    from vllm.config import DeviceConfig, VllmConfig
    from vllm_ascend.ascend_config import get_ascend_config, init_ascend_config

    assert ours_loaded() == []
    balance_on = {"scheduler_config": {"enable_balance_scheduling": True}}
    # CPU: torch_npu is stood in here (vllm-ascend's CI builds it on its NPU device).
    config = VllmConfig(additional_config=balance_on, device_config=DeviceConfig(device="cpu"))
    # What vllm-ascend's own config tests give AscendConfig: model metadata, no model.
    config.model_config = SimpleNamespace(
        is_moe=True, is_deepseek_mla=False, use_mla=False, enforce_eager=True,
        architectures=[], hf_text_config=SimpleNamespace(),
    )  # fmt: skip
    with patch("vllm_ascend.platform.NPUPlatform.check_and_update_config"):
        init_ascend_config(config)
    assert get_ascend_config().scheduler_config.enable_balance_scheduling is True
    assert ours_loaded() == []

    scheduler = _make_balance_scheduler(max_num_seqs=2)
    for request in _create_requests(3, num_tokens=8):
        scheduler.add_request(request)
    _frozen_by_balance(scheduler, frozen=False)
    frozen = _frozen_by_balance(scheduler, frozen=True)
    assert scheduler.admission_frozen and frozen.scheduled_new_reqs == []
    assert ours_loaded() == []
