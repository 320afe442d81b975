"""pytest plugin: apply the mutant named by ``VLLM_BALANCE_MUTANT`` before collection.

Loaded by ``tests/mutation/run.py`` with ``-p pytest_mutant`` (this directory on PYTHONPATH).
``pytest_configure`` runs before any test module is imported, which the compat mutants need.
The plugin writes what it applied, and on which path, to ``VLLM_BALANCE_MUTANT_REPORT`` so the
runner can tell a killed mutant from one that was never applied.
"""

from __future__ import annotations

import json
import os

import mutants
import pytest

ENV_NAME = "VLLM_BALANCE_MUTANT"
ENV_REPORT = "VLLM_BALANCE_MUTANT_REPORT"
MUTANT_KEY = pytest.StashKey[str]()


def pytest_configure(config) -> None:
    name = os.environ.get(ENV_NAME, "none")
    mutants.apply(name)
    import vllm_balance

    scheduler_cls = vllm_balance.BalanceScheduler  # derives the compat class, mutated or not
    config.stash[MUTANT_KEY] = name
    report = os.environ.get(ENV_REPORT)
    if report:
        with open(report, "w", encoding="utf-8") as out:
            json.dump(
                {"mutant": name, "path": vllm_balance.active_path(), "class": str(scheduler_cls)},
                out,
            )


def pytest_report_header(config) -> str:
    return f"vllm-balance mutant: {config.stash.get(MUTANT_KEY, 'none')}"
