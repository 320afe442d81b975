"""Shared fixtures: real vLLM objects from the pinned wheel (see vllm_balance.factories)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))


def session_pin_name() -> str | None:
    """The pin the nox session installed (None when run outside nox)."""
    return os.environ.get("VLLM_BALANCE_PIN")


def session_has_seam() -> bool | None:
    flag = os.environ.get("VLLM_BALANCE_SEAM")
    return None if flag is None else flag == "1"


@pytest.fixture(autouse=True)
def _no_deprecated_env(monkeypatch):
    # The deprecated env var would leak into every config read; tests that need it set it.
    monkeypatch.delenv("VLLM_ASCEND_BALANCE_SCHEDULING", raising=False)
