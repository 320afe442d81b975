"""The conftest of vLLM's tests that upstream_patch/run_vllm_tests.py extracts; not vLLM's.

Offline, CPU-only stand-ins for what vLLM's own conftest and CI provide: hub model names become a
tiny local config (``facebook/opt-125m`` -> a tiny Llama; models that only the hub has, e.g. the
multimodal llava, skip the test), every ``VllmConfig`` gets ``DeviceConfig("cpu")``, and the hub
is offline. A pytest plugin in place of vLLM's conftest files, which run_vllm_tests.py does not
extract (``-p balance_testbed.vllm_own_conftest``).
"""

import importlib
import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# It must choose the side before anything imports the scheduler.
from balance_testbed import vllm_own_side  # noqa: E402, I001
from vllm.config import DeviceConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

# This repository's test factories (the test bed); vLLM's own tests/ is the `tests` package.
from balance_testbed.factories import tiny_model_dir  # noqa: E402

_BALANCE_CLASSES = {}
if os.environ.get("VLLM_BALANCE_SIDE") == "balance":
    import vllm_balance
    import vllm_balance.shim.scheduler as _shim_scheduler

    # Balance on for every balance scheduler these tests build (their configs do not ask for
    # it); one DP rank whose gathered count is 0 keeps the gate open.
    from vllm_balance.config import balance_options

    _shim_scheduler.read_options = balance_options
    _BALANCE_CLASSES = {
        Scheduler: vllm_balance.BalanceScheduler,
        AsyncScheduler: vllm_balance.BalanceAsyncScheduler,
    }

    def _balance_new(cls, *args, **kwargs):
        # Scheduler(...) and AsyncScheduler(...) build ours (a subclass, so Python then runs its
        # __init__), wherever the tests call them; the names stay upstream's classes, so the
        # tests that check vLLM's own class selection (get_scheduler_cls() is Scheduler) hold.
        return object.__new__(_BALANCE_CLASSES.get(cls, cls))

    Scheduler.__new__ = _balance_new

elif os.environ.get("VLLM_BALANCE_SIDE") == "vllm-ascend":
    # vllm-ascend's own balance module (run_vllm_tests.py --vllm-ascend): only that module, under
    # an empty vllm_ascend.patch.platform package (its __init__ would apply every platform
    # patch); torch_npu from testbed/ascend_standin/. Balance on, one DP rank: the gate is open.
    import types

    _root = os.environ["VLLM_BALANCE_ASCEND_ROOT"]
    from balance_testbed.vllm_ascend_standin import STUBS_ROOT

    sys.path[:0] = [_root, str(STUBS_ROOT)]
    import vllm_ascend.patch

    _platform = types.ModuleType("vllm_ascend.patch.platform")
    _platform.__path__ = [os.path.join(_root, "vllm_ascend", "patch", "platform")]
    sys.modules[_platform.__name__] = vllm_ascend.patch.platform = _platform
    _ascend_balance = importlib.import_module(f"{_platform.__name__}.patch_balance_schedule")

    _ascend_balance._balance_scheduling_enabled = lambda vllm_config: True
    # Their AscendConfig, read only for ShortRequestFirst (off by default), stood in: a release's
    # AscendConfig does not build on a newer vLLM (0.30.0rc2's on 0.34.0: PassConfig.enable_sp),
    # which is not the scheduler these tests measure.
    _ascend_balance.init_ascend_config = lambda vllm_config: types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(
            short_request_first_config=types.SimpleNamespace(enabled=False)
        )
    )
    # A release whose module has no asynchronous class (0.30.0rc2 as published) leaves
    # AsyncScheduler upstream's: that is what its users get under async scheduling.
    _BALANCE_CLASSES = {
        Scheduler: _ascend_balance.BalanceScheduler,
        AsyncScheduler: getattr(_ascend_balance, "BalanceAsyncScheduler", AsyncScheduler),
    }

    def _ascend_new(cls, *args, **kwargs):
        return object.__new__(_BALANCE_CLASSES.get(cls, cls))

    Scheduler.__new__ = _ascend_new

vllm_own_side.record(_BALANCE_CLASSES.values())

# Hub models the scheduler tests use for their config only; a tiny local config stands in.
_LOCAL_MODELS = {"facebook/opt-125m"}


def _model_config(*args, **kwargs):
    model, args = (args[0], args[1:]) if args else (kwargs.pop("model"), args)
    if model in _LOCAL_MODELS:
        # The tiny config has no tokenizer; the scheduler never tokenizes.
        model = tiny_model_dir(moe=False)
        kwargs["skip_tokenizer_init"] = True
    elif not os.path.isdir(str(model)):
        pytest.skip(f"needs hub model {model} (offline run)")
    return ModelConfig(model, *args, **kwargs)


def _vllm_config(*args, **kwargs):
    kwargs.setdefault("device_config", DeviceConfig(device="cpu"))
    return VllmConfig(*args, **kwargs)


@pytest.fixture(autouse=True)
def _offline_cpu_configs(request, monkeypatch):
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if name == "tests" or name.startswith("tests."):
            if getattr(module, "ModelConfig", None) is ModelConfig:
                monkeypatch.setattr(module, "ModelConfig", _model_config)
            if getattr(module, "VllmConfig", None) is VllmConfig:
                monkeypatch.setattr(module, "VllmConfig", _vllm_config)


@pytest.fixture
def caplog_vllm(caplog, monkeypatch):
    # Stands in for vLLM's fixture of that name: vLLM's log records reach caplog, at INFO.
    import logging

    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    with caplog.at_level(logging.INFO):
        yield caplog


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_test: vLLM CI marker")
