"""Copied into a vllm-ascend tree as a test file by tests/test_vllm_ascend_series.py; run there.

vllm-ascend hooks its service profiler (``vllm_ascend/profiling_config.py``) and its metric
provider (``vllm_ascend/observability/config/base_metrics.yaml``) on
``BalanceScheduler.schedule``. A scheduler whose balance path runs code that never enters the
hooked method would leave both blind (each hooks by replacing the class attribute, as this
probe does). This probe counts the calls of the hooked method over three steps with balance on.
It uses the balance test module's own scheduler factory (vllm-ascend's test helpers).
"""

import importlib
import re
from pathlib import Path

from tests.ut.patch.platform.test_patch_balance_schedule import (
    _create_requests,
    _make_balance_scheduler,
    _make_output,
)

ROOT = Path(__file__).resolve().parents[2]
HOOK_FILES = (
    "vllm_ascend/profiling_config.py",
    "vllm_ascend/observability/config/base_metrics.yaml",
)
BALANCE_SCHEDULE = "vllm_ascend.patch.platform.patch_balance_schedule:BalanceScheduler.schedule"
STEPS = 3


def test_both_hook_lists_name_balance_scheduler_schedule():
    for name in HOOK_FILES:
        symbols = re.findall(r"symbol: (\S+)", (ROOT / name).read_text())
        assert BALANCE_SCHEDULE in symbols, name


def test_the_hooked_method_runs_every_step_with_balance_on(monkeypatch):
    module_name, _, qualified = BALANCE_SCHEDULE.partition(":")
    class_name, method = qualified.split(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    original = vars(cls)[method]
    calls = []

    def hooked(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, hooked)
    scheduler = _make_balance_scheduler()
    assert scheduler._balance_enabled
    for request in _create_requests(2, num_tokens=32, max_tokens=8):
        scheduler.add_request(request)
    for _ in range(STEPS):
        output = scheduler.schedule()
        scheduler.update_from_output(output, _make_output(scheduler))
    assert len(calls) == STEPS
