"""DP deployment shapes at start-up: what balance refuses, and how it starts under fault tolerance
(docs/operations.md, "DP deployment shapes").

The shapes it follows are tested where they run: elastic EP in ``multiproc/test_resize.py``,
pause and sleep in ``multiproc/test_pause.py``, fault-tolerance recovery in
``multiproc/test_fault_tolerance.py``.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import vllm.v1.engine.core as core_module
from test_contract import gloo_groups
from vllm.config import ParallelConfig
from vllm.distributed import stateless_destroy_torch_distributed_process_group
from vllm.v1.engine.core import DPEngineCoreProc

import vllm_balance
from balance_testbed import factories
from vllm_balance import activation, registry
from vllm_balance.log import LOGGER_NAME
from vllm_balance.shim.engine_core import BalanceDPEngineCoreProc
from vllm_balance.shim.gather import gather_timeout_under_fault_tolerance
from vllm_balance.shim.watchdog import FAILED

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


def fault_tolerant_config(recovery_s: int = 120, **parallel):
    """DP=2 MoE with fault tolerance on: set on the built config, as vLLM refuses it on CPU."""
    config = dp_moe_config(enable_fault_tolerance=True, **parallel)
    config.parallel_config.fault_tolerance_config.engine_recovery_timeout_sec = recovery_s
    return config


needs_fault_tolerance = pytest.mark.skipif(
    FAULT_TOLERANCE not in ParallelConfig.__dataclass_fields__,
    reason="this vLLM has no fault tolerance (enable_fault_tolerance)",
)


@needs_fault_tolerance
def test_fault_tolerance_activates_balance_and_logs_the_gather_timeout(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        assert activation.activate_for(fault_tolerant_config(), dp_rank=1) is True
    assert core_module.DPEngineCoreProc is BalanceDPEngineCoreProc
    assert (
        ", fault tolerance: gather timeout 60 s (half of engine_recovery_timeout_sec=120)"
        in caplog.text
    ), caplog.text


@needs_fault_tolerance
@pytest.mark.parametrize(
    ("cpu_s", "expected"),
    [
        (None, (60.0, "half of engine_recovery_timeout_sec=120")),
        (30, (30.0, "cpu_distributed_timeout_seconds=30")),
        (600, (60.0, "half of engine_recovery_timeout_sec=120")),
    ],
)
def test_fault_tolerance_gather_timeout_is_half_the_recovery_window_or_vllms_cpu_timeout(
    cpu_s, expected
):
    config = fault_tolerant_config(cpu_distributed_timeout_seconds=cpu_s)
    assert gather_timeout_under_fault_tolerance(config.parallel_config) == expected


@needs_fault_tolerance
def test_fault_tolerance_off_leaves_the_gather_to_gloos_timeout():
    config = dp_moe_config(enable_fault_tolerance=False, cpu_distributed_timeout_seconds=30)
    assert gather_timeout_under_fault_tolerance(config.parallel_config) is None
    assert activation.activate_for(config) is True
    assert core_module.DPEngineCoreProc is BalanceDPEngineCoreProc


@needs_fault_tolerance
def test_fault_tolerance_is_refused_where_the_dp_busy_loop_does_not_reach_vllms_recovery(
    monkeypatch,
):
    def run_busy_loop(self):  # a vLLM whose DP loop fault_tolerant_wrapper does not wrap
        raise AssertionError("never run")

    monkeypatch.setattr(DPEngineCoreProc, "run_busy_loop", run_busy_loop)
    with pytest.raises(activation.BalanceConfigError) as excinfo:
        activation.activate_for(fault_tolerant_config())
    assert str(excinfo.value) == (
        "balance scheduling cannot run with this vLLM's fault tolerance "
        "(--enable-fault-tolerance): its DP engine core's busy loop "
        "(DPEngineCoreProc.run_busy_loop) is not wrapped by fault_tolerant_wrapper, so a balance "
        "gather that fails on a peer's fault would not reach vLLM's recovery; turn off one of "
        "enable_balance_scheduling and --enable-fault-tolerance"
    )
    assert core_module.DPEngineCoreProc is DPEngineCoreProc  # nothing installed


@needs_fault_tolerance
def test_fault_tolerance_is_refused_without_a_positive_gather_timeout():
    with pytest.raises(activation.BalanceConfigError) as excinfo:
        activation.activate_for(fault_tolerant_config(recovery_s=0))
    assert str(excinfo.value) == (
        "balance scheduling cannot run with vLLM's fault tolerance (--enable-fault-tolerance) "
        "and half of engine_recovery_timeout_sec=0: no positive timeout bounds balance's per-step "
        "gather, so after a rank's fault the healthy ranks would wait in it instead of reaching "
        "vLLM's recovery; set it above 0, or turn off one of enable_balance_scheduling and "
        "--enable-fault-tolerance"
    )
    assert core_module.DPEngineCoreProc is DPEngineCoreProc


@needs_fault_tolerance
def test_fault_tolerance_without_balance_is_not_touched():
    config = dp_moe_config(enable_fault_tolerance=True)
    config.additional_config["enable_balance_scheduling"] = False
    assert activation.activate_for(config) is False
    assert core_module.DPEngineCoreProc is DPEngineCoreProc


@needs_fault_tolerance
@pytest.mark.parametrize("collective", ["all_gather", "recursive_doubling"])
def test_fault_tolerance_gather_a_peer_never_enters_raises_after_its_timeout_logged_failed(
    caplog, collective
):
    """Rank 1 never gathers: rank 0's gather raises after 0.5 s (half of a 1 s recovery window),
    and the watchdog logs it as failed at once, though its warn_s (5 s) was never reached."""
    config = fault_tolerant_config(recovery_s=1)
    config.additional_config["balance_collective"] = collective
    scheduler = factories.make_scheduler(vllm_balance.BalanceScheduler, config)
    group, peer = gloo_groups(2)
    scheduler.follow_dp_group(group)
    ended: dict = {}

    def gather() -> None:
        try:
            scheduler.balance_gather()
        except RuntimeError as exc:
            ended["raised"] = exc
        ended["after"] = time.monotonic() - started

    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        started = time.monotonic()
        gathering = threading.Thread(target=gather, daemon=True)
        gathering.start()
        gathering.join(timeout=5.0)
        if gathering.is_alive():  # no timeout: only the peer's end releases it
            stateless_destroy_torch_distributed_process_group(peer)
            gathering.join(timeout=10.0)
    assert 0.4 <= ended.get("after", float("inf")) <= 3.0, ended  # none: waited 5 s and more
    assert "Timed out" in str(ended["raised"]), ended
    assert scheduler.balance_gate.watchdog.started is None
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith(FAILED)]
    assert len(failed) == 1 and failed[0].startswith(f"{FAILED}: DP0 gather #1 raised after"), (
        caplog.text
    )
