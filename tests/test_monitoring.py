"""The deployable monitoring files: Prometheus rules and the Grafana dashboard (deploy/).

promtool checks the rules and runs their unit tests (``deploy/prometheus/balance-rules.test.yml``:
synthetic series, each alert firing in one case and silent in another). The names the rules and
panels use are checked against what vLLM's ``/metrics`` serves with the plugin, built from the
real stat loggers (vLLM's and ``shim/metrics.py``'s), so a renamed counter fails here. The real
Prometheus scraping the real server is ``tests/e2e/test_prometheus.py``.
"""

from __future__ import annotations

import re
import shutil

import pytest
import yaml
from conftest import ROOT
from monitoring import (
    E2E_DURATIONS,
    RULE_TESTS,
    RULES,
    alerts,
    dashboard_panels,
    duration_free,
    promtool,
    recorded,
    series_names,
    shortened,
    undefined_names,
)

import vllm_balance
from balance_testbed.factories import make_scheduler, make_vllm_config
from tools.check_docs import anchors
from vllm_balance.shim.metrics import COUNTERS, GAP_GAUGE

OPERATIONS = ROOT / "docs" / "operations.md"
RUNBOOK = "docs/operations.md#monitoring"
# The deliberate break: one letter off a counter's name in one rule.
GOOD_NAME, WRONG_NAME = "vllm:balance_frozen_steps_total", "vllm:balance_frozen_step_total"


def served_names() -> set[str]:
    """Sample names on vLLM's /metrics with balance on: vLLM's Prometheus logger and the plugin,
    as vLLM loads them, after one balance message from each of two engines."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.v1.metrics.loggers import StatLoggerManager, load_stat_logger_plugin_factories
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    config = make_vllm_config(
        data_parallel_size=2, additional_config={"enable_balance_scheduling": True}
    )
    plugins = load_stat_logger_plugin_factories()
    manager = StatLoggerManager(config, engine_idxs=[0, 1], custom_stat_loggers=plugins)
    for engine in (0, 1):
        scheduler = make_scheduler(vllm_balance.BalanceScheduler, config, log_stats=True)
        scheduler.balance_gate.stats.record_gather([1, 1])
        scheduler.balance_gate.metrics.publish(scheduler.balance_gate.stats)
        manager.record(
            scheduler_stats=scheduler.make_stats(), iteration_stats=None, engine_idx=engine
        )
    text = generate_latest(get_prometheus_registry()).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def served():
    return served_names()


def test_promtool_accepts_the_rules():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_of_the_rules_pass():
    done = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_a_firing_and_a_silent_case():
    cases: dict[str, list[bool]] = {}
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(bool(case.get("exp_alerts")))
    assert {name: sorted(set(fired)) for name, fired in cases.items()} == {
        name: [False, True] for name in alerts()
    }


def test_every_recording_rule_has_a_unit_test_of_its_value():
    tested = set()
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        tested |= {case["expr"] for case in test.get("promql_expr_test", [])}
    assert tested == set(recorded())


def test_alerts_wait_their_window_and_link_the_monitoring_runbook():
    """A `for:` on each (the watchdog counter's alert holds itself for its 10m increase), a
    runbook naming docs/operations.md's Monitoring section, which names every alert."""
    assert "monitoring" in anchors(OPERATIONS)
    section = OPERATIONS.read_text().split("## Monitoring", 1)[1].split("\n## ", 1)[0]
    for name, rule in alerts().items():
        assert "for" in rule or "increase(" in rule["expr"], name
        assert RUNBOOK in rule["annotations"]["runbook"], name
        assert f"`{name}`" in section, name


def test_the_served_names_are_shim_metrics_names(served):
    """The plugin's counters (shim/metrics.py's COUNTERS, GAP_GAUGE) on the page checked below."""
    ours = {f"vllm:{name}_total" for name, _, _ in COUNTERS} | {f"vllm:{GAP_GAUGE[0]}"}
    assert ours <= served
    assert "vllm:num_requests_running" in served


def test_rules_and_panels_name_only_served_series_and_recording_rules(served):
    assert undefined_names(served) == {}


def test_a_wrong_metric_name_in_one_rule_is_caught(served, tmp_path):
    """Negative control: the name check names the rule, and promtool's unit tests fail."""
    text = RULES.read_text()
    assert text.count(GOOD_NAME) == 1
    broken = text.replace(GOOD_NAME, WRONG_NAME)
    assert undefined_names(served, broken) == {"balance:frozen_steps:ratio_rate5m": {WRONG_NAME}}
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    (tmp_path / RULES.name).write_text(broken)
    done = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0 and "balance:frozen_steps:ratio_rate5m" in done.stderr, done


def test_balance_panels_query_recording_rules_and_show_each_of_them():
    """The balance row's panels read recording rules only; vLLM's row is vLLM's own series."""
    rules_shown = set()
    for panel in dashboard_panels():
        names = set().union(*map(series_names, panel["exprs"]))
        if panel["row"].startswith("Balance"):
            assert names and names <= set(recorded()), panel
            rules_shown |= names
        else:
            assert names and all(n.startswith("vllm:") for n in names), panel
            assert not any(n.startswith("vllm:balance_") for n in names), panel
    assert rules_shown == set(recorded())


def test_the_e2e_short_windows_differ_from_the_shipped_rules_in_durations_only():
    shipped = RULES.read_text()
    short = shortened(shipped, E2E_DURATIONS)
    assert duration_free(short) == duration_free(shipped)
    assert short != shipped
    # The comparison sees anything else: a threshold changed beside the durations.
    assert duration_free(re.sub(r"> 0\.9\b", "> 0.5", short)) != duration_free(shipped)
