"""Outcomes from a pytest JUnit XML report, for scripts that run pytest in a child process
(upstream_patch/run_vllm_tests.py, upstream_patch/reach.py, tests/mutation/run.py)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path


def junit_outcomes(report: Path) -> dict[str, str]:
    """``classname::name`` -> passed / skipped / failed (an error counts as failed)."""
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = (
            "failed"
            if kinds & {"failure", "error"}
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
    return outcomes


def junit_failures(report: Path) -> dict[str, str]:
    """``classname::name`` -> the failure's (or error's) message and text, for failed tests."""
    failures = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                text = f"{child.get('message', '')}\n{child.text or ''}"
                failures[f"{case.get('classname')}::{case.get('name')}"] = text
    return failures


def tally(outcomes: dict[str, str], select=lambda test_id: True) -> dict[str, int]:
    """How many of the selected tests passed, failed and skipped."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for test_id, outcome in outcomes.items():
        if select(test_id):
            counts[outcome] += 1
    return counts
