"""The deployable monitoring files (deploy/): read them, name what their queries use, run promtool.

Shared by the unit tests (``tests/test_monitoring.py``) and the real Prometheus scraping the real
server (``tests/e2e/test_prometheus.py``). The binaries come from ``tools/prometheus_binaries.py``
(Debian's package, unpacked into the cache by the test sessions); where they are missing the
tests skip with the recorded reason.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tools.prometheus_binaries import BINARIES, refusal, which

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "balance-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "balance-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "vllm-balance-dashboard.json"
# What the dashboard's template variable becomes where a test runs its queries itself.
MODEL_VARIABLE = "$model_name"
# Names of series: vLLM's and this package's (vllm:...) and the recording rules' (balance:...).
SERIES_NAME = re.compile(r"\b(?:vllm|balance):[A-Za-z0-9_:]+")
RANGE = re.compile(r"\[(\d+[smhd])\]")


def binary(name: str) -> Path:
    """The binary's path, or a skip saying why it is missing (never a silent pass)."""
    path = which(name)
    if path is None:
        pytest.skip(refusal())
    return path


def missing_binaries() -> str | None:
    """Why a binary is missing (a skip reason), or None: for a check that must not skip halfway."""
    return refusal() if any(which(name) is None for name in BINARIES) else None


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(binary("promtool")), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def rule_groups(text: str | None = None) -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text() if text is None else text)["groups"]


def rules(text: str | None = None) -> list[dict[str, Any]]:
    return [rule for group in rule_groups(text) for rule in group["rules"]]


def recorded(text: str | None = None) -> dict[str, str]:
    """Recording rule name -> its expression."""
    return {rule["record"]: rule["expr"] for rule in rules(text) if "record" in rule}


def alerts(text: str | None = None) -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules(text) if "alert" in rule}


def series_names(expr: str) -> set[str]:
    return set(SERIES_NAME.findall(expr))


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel with queries: ``{"title", "row", "exprs"}`` (row: the title above it)."""
    panels, row = [], None
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            continue
        exprs = [target["expr"] for target in panel.get("targets", [])]
        panels.append({"title": panel["title"], "row": row, "exprs": exprs})
    return panels


def dashboard_query(expr: str, model_name: str) -> str:
    """A dashboard query with its model variable filled, as Grafana sends it."""
    return expr.replace(MODEL_VARIABLE, model_name)


def undefined_names(exported: set[str], text: str | None = None) -> dict[str, set[str]]:
    """Per rule and dashboard panel, the series names it uses that are neither in ``exported``
    (a /metrics page's sample names) nor a recording rule (of ``text``): {} when all resolve."""
    known = exported | set(recorded(text))
    found = {
        rule.get("record") or rule["alert"]: series_names(rule["expr"]) for rule in rules(text)
    }
    for panel in dashboard_panels():
        found[f"panel {panel['title']!r}"] = set().union(*map(series_names, panel["exprs"]))
    return {where: names - known for where, names in found.items() if names - known}


# ----------------------------------------------------------------------- short windows for tests
def shortened(text: str, durations: dict[str, str]) -> str:
    """The rules file with the range selectors and ``for:`` values in ``durations`` replaced:
    the real server test waits seconds, not minutes. Nothing else changes (checked by
    ``duration_free``)."""

    def short(duration: str) -> str:
        return durations.get(duration, duration)

    groups = rule_groups(text)
    for group in groups:
        for rule in group["rules"]:
            rule["expr"] = RANGE.sub(lambda m: f"[{short(m.group(1))}]", rule["expr"])
            if "for" in rule:
                rule["for"] = short(rule["for"])
    return yaml.safe_dump({"groups": groups}, sort_keys=False)


def duration_free(text: str) -> list[dict[str, Any]]:
    """The rules with every range selector and ``for:`` value blanked: two files equal here
    differ in those durations only."""
    blank = []
    for rule in rules(text):
        rule = dict(rule, expr=RANGE.sub("[_]", rule["expr"]))
        if "for" in rule:
            rule["for"] = "_"
        blank.append(rule)
    return blank


# The real-server test's windows: the gather-stall alerts' 1m rate and `for:` in seconds
# (its server publishes every 0.5 s and Prometheus scrapes every second).
E2E_DURATIONS = {"1m": "10s", "2m": "20s"}
