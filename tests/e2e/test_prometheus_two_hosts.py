"""A real Prometheus scraping the two-host server's head node: both engines in every query.

On demand (``nox -s e2e-multinode``): the shim row's two-host server
(``tests/e2e/multinode.py``), once its load is done, runs ``tests/e2e/test_prometheus.py``'s
check from the head node's namespace without the pause (that row has no faults): Prometheus on
the head's loopback scrapes its ``/metrics``, where the headless node's rank arrives with its
SchedulerStats. Without root or ``ip netns`` every test skips, saying why.
"""

from __future__ import annotations

import functools

import pytest

from tests.e2e.test_prometheus import (
    assert_no_stall_alert,
    assert_rules_equal_the_servers_counters,
    assert_series_per_engine,
    assert_stored_within_a_scrape,
    checked,
    prometheus_check,
)

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(3600)]

# Run on the shim row's two-host server, on its head node (RunCache.register_while_up).
WHILE_UP_TWO_HOSTS = {"shim": {"prometheus": functools.partial(prometheus_check, pause=False)}}


@pytest.fixture(scope="module")
def check(two_host_runs):
    return checked(two_host_runs.get("shim").while_up["prometheus"])


def test_both_engines_in_every_rule_and_dashboard_query_under_load(check):
    assert_series_per_engine(check["under_load"])


def test_rules_equal_the_head_servers_counters_after_the_load(check):
    assert check["load_error"] is None
    assert_rules_equal_the_servers_counters(check)


def test_the_head_servers_counters_are_stored_within_a_scrape(check):
    assert_stored_within_a_scrape(check)


def test_no_stall_alert_on_the_healthy_two_host_server(check):
    assert_no_stall_alert(check)
