"""Shared fixtures: real vLLM objects from the pinned wheel (see balance_testbed/factories.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def session_pin_name() -> str | None:
    """The pin the nox session installed (None when run outside nox)."""
    return os.environ.get("VLLM_BALANCE_PIN")


def session_has_seam() -> bool | None:
    flag = os.environ.get("VLLM_BALANCE_SEAM")
    return None if flag is None else flag == "1"


# Set by `nox -s ascend`: the run counts as Ascend evidence only if torch_npu is imported (so
# torch.npu exists for the host-only test to trap) and sees a device; otherwise it fails.
REQUIRE_NPU_ENV = "VLLM_BALANCE_REQUIRE_NPU"


def npu_missing_reason() -> str | None:
    """None when torch_npu imports and sees an NPU; otherwise why not."""
    try:
        import torch
        import torch_npu  # noqa: F401
    except Exception as exc:  # ImportError, or torch_npu failing to load its runtime
        return f"torch_npu cannot be imported ({type(exc).__name__}: {exc})"
    if not torch.npu.is_available():
        return "torch_npu sees no NPU"
    return None


def pytest_configure(config) -> None:
    if os.environ.get(REQUIRE_NPU_ENV) == "1":
        reason = npu_missing_reason()
        if reason is not None:
            raise pytest.UsageError(f"{REQUIRE_NPU_ENV}=1 but {reason}")


# Set by noxfile.py in the seam sessions only (mutation and reach runs see every test).
SKIP_PATH_INDEPENDENT_ENV = "VLLM_BALANCE_SKIP_PATH_INDEPENDENT"


def pytest_collection_modifyitems(config, items) -> None:
    # A test whose answer the hold cannot change (logging, the API server's side of the metrics,
    # the engine core's gather, pause and resize, the simulator, the records) gives the same
    # answer with the seam applied: the no-seam session of each pin runs it, the seam sessions
    # spend their time on the shim path.
    if os.environ.get(SKIP_PATH_INDEPENDENT_ENV) != "1":
        return
    skip = pytest.mark.skip(reason="path-independent: runs in the pin's no-seam session")
    for item in items:
        if item.get_closest_marker("path_independent"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _vllm_log_records_reach_caplog(monkeypatch):
    # The package logs as a child of "vllm" (vllm_balance/log.py), which vLLM configures with
    # propagate=False (0.30 at import; 0.31+ in configure_logging()): caplog listens at the root.
    import logging

    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture(autouse=True)
def _no_deprecated_env(monkeypatch):
    # The deprecated env var would leak into every config read; tests that need it set it.
    monkeypatch.delenv("VLLM_ASCEND_BALANCE_SCHEDULING", raising=False)


@pytest.fixture
def fresh_once_logs():
    """vLLM's ``warning_once`` / ``info_once`` remember a message for the life of the process
    (an ``lru_cache`` per level in ``vllm.logger``, no public reset): a test that checks a
    once-only warning starts as a fresh engine process does (fork children inherit it)."""
    import vllm.logger

    for name in ("_print_warning_once", "_print_info_once"):
        getattr(vllm.logger, name).cache_clear()


@pytest.fixture
def forked_probe(tmp_path, monkeypatch):
    """Install the handshake probe for fork children (they inherit it); upstream's afterwards."""
    from vllm.v1.engine.core import EngineCoreProc

    from balance_testbed.engine_probe import install_probe

    monkeypatch.setattr(EngineCoreProc, "_perform_handshakes", EngineCoreProc._perform_handshakes)
    report = str(tmp_path / "report.json")
    install_probe(report)
    return report


def no_derived_copy_reason() -> str | None:
    """Why the derived copy is out of service on the installed vLLM, or None: its schedule() is
    verified for the pause-state hold and the copy cannot be derived from it (0.34+: no slot
    check). A release the fingerprints do not clear keeps the copy's tests, red until verified."""
    from vllm_balance.compat.derive import Phase2AUnavailable, build_phase2a_schedule
    from vllm_balance.compat.pause_state import (
        PAUSE_STATE,
        installed_schedule_fingerprint,
        verified_holds,
    )

    entry = verified_holds().get(installed_schedule_fingerprint())
    if entry is None or entry.hold != PAUSE_STATE:
        return None
    try:
        build_phase2a_schedule()
    except Phase2AUnavailable as exc:
        return f"the pause-state hold serves {entry.release}, no copy derives: {exc}"
    return None
