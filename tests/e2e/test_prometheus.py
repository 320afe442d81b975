"""A real Prometheus scraping the real DP=2 server: the deployable rules and dashboard (deploy/).

Run on the shim row's live server after its own load (``RunCache.register_while_up``):
Prometheus (``tests/e2e/prometheus.py``) on loopback, scraping ``/metrics`` every second with
the shipped rules, whose gather-stall windows are cut to seconds (``E2E_DURATIONS``; the unit
tests check that only those durations differ). Then, as one record the tests below assert on:

1. under load: every recording rule and every dashboard query has a series per engine, and the
   counters Prometheus stored lie between two scrapes of ``/metrics`` the test made around them;
2. after the load (counters still): each rule equals what the server's own ``/metrics`` before
   and after the load gives, and those counters equal one of each rank's stats lines;
3. engine core DP1 paused (SIGSTOP) under load: ``BalanceGatherBlocked`` pending and firing
   within its window, resolved after SIGCONT; every request completes.

The numbers (each value beside the server's counters, times to firing and resolution) go to
``prometheus.json`` beside the server's log.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from dataclasses import asdict

import pytest

from balance_testbed.load import BackgroundLoad, make_prompts
from balance_testbed.server import VllmServer
from balance_testbed.server_log import (
    balance_metrics_per_engine,
    metric_samples,
    metrics_as_log_lines,
    stats_lines_per_rank,
)
from balance_testbed.waiting import wait_for
from tests.e2e.prometheus import SCRAPE_S, PrometheusServer
from tests.e2e.runs import LOAD_REQUESTS, STALL_S
from tests.monitoring import (
    E2E_DURATIONS,
    RULES,
    dashboard_panels,
    dashboard_query,
    missing_binaries,
    recorded,
    shortened,
)

pytestmark = pytest.mark.timeout(1800)

MODEL_NAME = "tiny-moe"
ENGINES = ["0", "1"]
BLOCKED, STOPPED = "BalanceGatherBlocked", "BalanceRankCountersStopped"
# The short rules: BalanceGatherBlocked's steps rate over 10 s goes to 0 about 10 s after the
# last step, pending then, firing 10 s later. Slack for a loaded 2-core machine.
PENDING_WITHIN_S = 10.0 + 10.0
FIRING_WITHIN_S = 20.0 + 10.0
RESOLVED_WITHIN_S = 10.0
# The rank stays stopped until the alert fires (plus this) or for at most PAUSE_MAX_S.
AFTER_FIRING_S = 2.0
# After the resolution, for the watchdog's counter (sent with the rank's next stats) to fire
# BalanceGatherWasBlocked, recorded in the report.
WAS_BLOCKED_S = 5.0
PAUSE_MAX_S = 60.0
# ~1,000 steps on 8 seats (~20 s here): requests still run on both ranks when one is stopped.
PAUSE_PROMPTS = dict(count=LOAD_REQUESTS, seed=1, min_tokens=150, max_tokens=200)
# Long enough (~2,000 steps on 8 seats) to still run after the look under load, which on a busy
# machine starts seconds after the first tokens (the client's streams share this process): at
# ~1,000 steps the load had ended before the look's first scrape in 2 runs of 3 on 2 cores.
LOAD_PROMPTS = dict(count=2 * LOAD_REQUESTS, seed=3, min_tokens=100, max_tokens=200)
# Where the look still came after the load's end (37 s after its first tokens in one CI run), it
# is taken again under a fresh load: a look at an idle server says nothing about one under load.
LOOKS = 3
# The look reads each query's newest value in this window: on 2 busy cores a scrape of the
# server's /metrics can time out (5-29 s seen), and Prometheus marks every series of that target
# stale until the next one, so an instant query can fall in the gap, as a dashboard would show.
LOOK_BACK = "15s"
QUIET_TIMEOUT_S = 60.0
# The 5m recording rules' range, in seconds (deferred admissions per second = increase / it).
RATE_RANGE_S = 300.0


def scrape(server: VllmServer) -> dict:
    """The server's own /metrics: balance counters and vLLM's gauges per engine, and the text."""
    text = server.http_text("/metrics")
    gauges: dict[str, dict[str, float]] = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        for sample in metric_samples(text, name):
            if sample.name == name:
                gauges.setdefault(sample.labels["engine"], {})[name] = sample.value
    balance = {str(e): values for e, values in balance_metrics_per_engine(text).items()}
    return {"at": time.time(), "balance": balance, "gauges": gauges, "text": text}


def queries() -> dict[str, str]:
    """Every recording rule by its name, and every dashboard query with its model filled."""
    found = {name: name for name in recorded()}
    for panel in dashboard_panels():
        for expr in panel["exprs"]:
            found[f"panel {panel['title']}: {expr}"] = dashboard_query(expr, MODEL_NAME)
    return found


def stall_alerts(prom: PrometheusServer) -> list[dict]:
    return [a for a in prom.alerts() if a["name"] in (BLOCKED, STOPPED)]


def under_load(server: VllmServer, prom: PrometheusServer, record: dict) -> None:
    """Step 1, while ``LOAD_REQUESTS`` requests run. Queries name the instant they evaluate at
    (Prometheus's ``time``): on a loaded machine the calls themselves may take seconds."""
    at = record["under_load_at"] = time.time()
    before = scrape(server)
    # Scraped after ``before`` was served: the sample Prometheus holds at ``stored_at``.
    stored_at = time.time() + 2 * SCRAPE_S
    time.sleep(4 * SCRAPE_S)  # and that scrape done before ``after``
    after = scrape(server)
    counters = [name for name in before["balance"]["0"] if name.endswith("_total")]
    stored = {name: prom.query(f"vllm:balance_{name}", at=stored_at) for name in counters}
    record["within_a_scrape"] = {
        name: {
            e: [before["balance"][e][name], stored[name].get(e), after["balance"][e][name]]
            for e in ENGINES
        }
        for name in counters
    }
    record["under_load"] = {
        key: prom.query(f"last_over_time(({expr})[{LOOK_BACK}:{SCRAPE_S:.0f}s])", at=at)
        for key, expr in queries().items()
    }
    record["running_under_load"] = prom.query(
        f"max_over_time(vllm:num_requests_running[{LOOK_BACK}])", at=at
    )
    record["stall_alerts_under_load"] = stall_alerts(prom)


def after_load(server: VllmServer, prom: PrometheusServer, base: dict, record: dict) -> None:
    """Step 2: the rules beside the server's counters, once the counters are still."""

    def no_step_in_any_rate_window() -> bool:
        return set(prom.query("balance:steps:rate1m").values()) == {0.0}

    if wait_for(no_step_in_any_rate_window, QUIET_TIMEOUT_S, SCRAPE_S) is None:
        raise RuntimeError(f"steps still counted {QUIET_TIMEOUT_S:.0f} s after the load")
    end = scrape(server)
    time.sleep(3 * SCRAPE_S)  # scraped after ``end``, the rules evaluated
    record["quiet"] = {key: prom.query(expr) for key, expr in queries().items()}
    record["stored_after"] = {
        name: prom.query(f"vllm:balance_{name}") for name in end["balance"]["0"]
    }
    scraped = sorted(t for series in prom.samples("up", 600).values() for t, _ in series)
    record["server"] = {
        "before": base["balance"],
        "after": end["balance"],
        "gauges_after": end["gauges"],
        "scraped_for_s": round(time.time() - scraped[0], 1),
        # What Prometheus extrapolates by: its samples' mean interval (late on a busy machine).
        "scrape_interval_s": (scraped[-1] - scraped[0]) / max(len(scraped) - 1, 1),
    }
    record["after_as_log_lines"] = {str(e): v for e, v in metrics_as_log_lines(end["text"]).items()}
    lines = stats_lines_per_rank(server.log_text())
    record["stats_lines_tail"] = {str(e): v[-3:] for e, v in lines.items()}
    record["after_in_stats_lines"] = {
        str(e): v in lines.get(e, []) for e, v in metrics_as_log_lines(end["text"]).items()
    }
    record["stall_alerts_quiet"] = stall_alerts(prom)


def pause_a_rank(server: VllmServer, prom: PrometheusServer, record: dict) -> None:
    """Step 3: SIGSTOP engine core DP1 under load until the alert fires, then SIGCONT."""
    [victim] = server.pids_named("VLLM::EngineCore_DP1")  # before the load: /proc is slow
    load = BackgroundLoad(server.base_url, make_prompts(**PAUSE_PROMPTS), stall_s=PAUSE_MAX_S * 3)
    load.start()
    if not load.wait_for_tokens(64, timeout_s=300):
        raise RuntimeError(f"no tokens before the pause\n{server.log_tail()}")

    def blocked(state: str | None = None) -> bool:
        alerts = [a for a in prom.alerts() if a["name"] == BLOCKED]
        return any(state is None or a["state"] == state for a in alerts)

    record["outstanding_at_sigstop"] = len(load.progress.outstanding)
    record["sigstop_at"] = time.time()
    os.kill(victim, signal.SIGSTOP)
    try:
        if wait_for(lambda: blocked("firing"), PAUSE_MAX_S, 0.25) is not None:
            time.sleep(AFTER_FIRING_S)
    finally:
        record["sigcont_at"] = time.time()
        os.kill(victim, signal.SIGCONT)
    wait_for(lambda: not blocked(), PAUSE_MAX_S, 0.25)
    time.sleep(WAS_BLOCKED_S)
    load.join(timeout=PAUSE_MAX_S * 3 + 600)
    record["alert_series"] = alert_series(prom, record["sigstop_at"])
    outcomes = load.outcomes or []
    record["pause_load"] = {
        "sent": PAUSE_PROMPTS["count"],
        "error": repr(load.error) if load.error else None,
        "wrong": [
            asdict(o)["prompt"]["key"]
            for o in outcomes
            if o.error or o.completion_tokens != o.prompt.max_tokens
        ],
        "completed": len(outcomes),
    }


def alert_series(prom: PrometheusServer, since: float) -> dict[str, dict[str, float]]:
    """Prometheus's own record (its ``ALERTS`` series, one sample per evaluation) since
    ``since``: first and last evaluation time of each alert, engine and state."""
    seconds = int(time.time() - since) + 2
    found = {}
    for series in prom.api("query", query=f"ALERTS[{seconds}s]")["result"]:
        labels = series["metric"]
        times = [float(t) for t, _ in series["values"] if float(t) >= since]
        if times:
            key = f"{labels['alertname']} {labels.get('engine')} {labels['alertstate']}"
            found[key] = {"first": min(times), "last": max(times)}
    return found


def prometheus_check(server: VllmServer, pause: bool = True) -> dict:
    """The whole check on a live server; failures go into the record, never past the server."""
    skip = missing_binaries()
    if skip:  # before anything starts: a skip raised inside the server's run would fail it
        return {"skip": skip}
    record: dict = {"error": None}
    rules = shortened(RULES.read_text(), E2E_DURATIONS)
    prom = PrometheusServer(server.workdir / "prometheus", f"127.0.0.1:{server.port}", rules)
    try:
        with prom:
            prom.wait_for_scrapes(3)
            record["stall_alerts_idle"] = stall_alerts(prom)
            base = scrape(server)
            for look in range(1, LOOKS + 1):
                record["looks"] = look
                load = BackgroundLoad(
                    server.base_url, make_prompts(**LOAD_PROMPTS), stall_s=STALL_S
                )
                load.start()
                if not load.wait_for_tokens(200, timeout_s=300):
                    raise RuntimeError(f"no tokens under load\n{server.log_tail()}")
                under_load(server, prom, record)
                looked_under_load = load.is_alive()  # requests still streamed after the look
                load.join(timeout=600)
                record["load_error"] = repr(load.error) if load.error else None
                if looked_under_load or load.error:
                    break
            after_load(server, prom, base, record)
            if pause:
                pause_a_rank(server, prom, record)
    except Exception:
        record["error"] = traceback.format_exc()
    record["prometheus_stop"] = prom.stopped
    (server.workdir / "prometheus.json").write_text(json.dumps(record, indent=1, default=str))
    return record


# Run on the shim row's live server (RunCache.register_while_up).
WHILE_UP = {"shim": {"prometheus": prometheus_check}}


@pytest.fixture(scope="module")
def check(server_runs):
    return checked(server_runs.get("shim").while_up["prometheus"])


# ------------------------------------------------------------------------------ the assertions
def checked(record: dict) -> dict:
    """The record the tests assert on: a skip where Prometheus is missing, else no error."""
    if "skip" in record:
        pytest.skip(record["skip"])
    assert record["error"] is None, record["error"]
    return record


def assert_series_per_engine(values: dict[str, dict[str, float]]) -> None:
    missing = {key: sorted(v) for key, v in values.items() if sorted(v) != ENGINES}
    assert missing == {}, missing


def assert_rules_equal_the_servers_counters(record: dict) -> None:
    """Ratios of the 5m rates are ratios of the counters' increases (one scrape's timestamps
    for both); the deferred rate is the increase over the range, extrapolated by Prometheus
    by at most about a scrape interval (the measured mean) at each end of the stored span."""
    server, quiet = record["server"], record["quiet"]
    span = min(server["scraped_for_s"], RATE_RANGE_S)
    interval = max(SCRAPE_S, server["scrape_interval_s"])
    for engine in ENGINES:
        before, after = server["before"][engine], server["after"][engine]
        grew = {name: after[name] - before[name] for name in after}
        assert grew["steps_total"] > 0, grew
        assert quiet["balance:frozen_steps:ratio_rate5m"][engine] == pytest.approx(
            grew["frozen_steps_total"] / grew["steps_total"], rel=1e-9
        )
        assert quiet["balance:gather_seconds_per_step:ratio_rate5m"][engine] == pytest.approx(
            grew["gather_seconds_total"] / grew["gathers_total"], rel=1e-9
        )
        deferred = quiet["balance:deferred_admissions:rate5m"][engine] * RATE_RANGE_S
        assert grew["deferred_admissions_total"] <= deferred * (1 + 1e-9)
        assert deferred <= grew["deferred_admissions_total"] * (1 + 3 * interval / span)
        gauges = server["gauges_after"]
        running = {e: gauges[e]["vllm:num_requests_running"] for e in ENGINES}
        mean = sum(running.values()) / len(running)
        assert quiet["balance:num_requests_running:imbalance"][engine] == running[engine] - mean
        held = running[engine] + gauges[engine]["vllm:num_requests_waiting"]
        assert quiet["balance:num_requests:in_engine"][engine] == held
        assert quiet["balance:steps:rate1m"][engine] == 0  # still: no step in its window
        for name, value in after.items():
            assert record["stored_after"][name][engine] == value, name


def test_every_rule_and_dashboard_query_has_a_series_per_engine_under_load(check):
    assert sum(check["running_under_load"].values()) > 0, check["running_under_load"]
    steps = check["within_a_scrape"]["steps_total"]
    stepping = all(before < after for before, _, after in steps.values())
    assert stepping, (steps, f"looks: {check['looks']}")
    assert_series_per_engine(check["under_load"])


def assert_stored_within_a_scrape(record: dict) -> None:
    """Each counter Prometheus holds lies between the server's /metrics before and after."""
    outside = {
        (name, engine): triple
        for name, engines in record["within_a_scrape"].items()
        for engine, triple in engines.items()
        if triple[1] is None or not triple[0] <= triple[1] <= triple[2]
    }
    assert outside == {}


def test_prometheus_stores_the_servers_counters_within_a_scrape(check):
    assert_stored_within_a_scrape(check)


def test_rules_equal_the_servers_counters_and_stats_lines_after_the_load(check):
    assert check["load_error"] is None
    assert_rules_equal_the_servers_counters(check)
    assert check["after_in_stats_lines"] == dict.fromkeys(ENGINES, True), check["stats_lines_tail"]


def assert_no_stall_alert(record: dict) -> None:
    """The silent case on the real server: idle, under load, and after it."""
    for phase in ("idle", "under_load", "quiet"):
        assert record[f"stall_alerts_{phase}"] == [], phase


def test_no_stall_alert_on_the_healthy_server(check):
    assert_no_stall_alert(check)


def pause_timings(record: dict) -> dict[str, float | None]:
    """Seconds from SIGSTOP to BalanceGatherBlocked's first pending and firing evaluation, and
    from SIGCONT to the first evaluation without it, by Prometheus's ALERTS series."""
    series = record["alert_series"]

    def times(state: str, end: str) -> list[float]:
        return [
            v[end]
            for key, v in series.items()
            if key.startswith(f"{BLOCKED} ") and key.endswith(state)
        ]

    pending, firing, last = (
        times("pending", "first"),
        times("firing", "first"),
        times("firing", "last"),
    )
    stop, cont = record["sigstop_at"], record["sigcont_at"]
    return {
        "pending_after_sigstop_s": round(min(pending) - stop, 1) if pending else None,
        "firing_after_sigstop_s": round(min(firing) - stop, 1) if firing else None,
        "firing_until_before_sigcont_s": round(cont - max(last), 1) if last else None,
        "resolved_after_sigcont_s": round(max(last) + SCRAPE_S - cont, 1) if last else None,
    }


def test_a_paused_rank_fires_the_blocked_gather_alert_within_its_window_then_it_resolves(check):
    assert check["outstanding_at_sigstop"] > 0  # stopped under load
    timings = pause_timings(check)
    print(f"BalanceGatherBlocked: {timings}; alerts {check['alert_series']}")
    assert timings["pending_after_sigstop_s"] is not None, check["alert_series"]
    assert timings["pending_after_sigstop_s"] <= PENDING_WITHIN_S, timings
    assert timings["firing_after_sigstop_s"] <= FIRING_WITHIN_S, timings
    # Still firing when the rank was resumed (the evaluation before SIGCONT), gone soon after.
    assert timings["firing_until_before_sigcont_s"] <= 1.5 * SCRAPE_S, timings
    assert timings["resolved_after_sigcont_s"] <= RESOLVED_WITHIN_S, timings
    stopped = [key for key in check["alert_series"] if key.startswith(f"{STOPPED} ")]
    assert not any(key.endswith("firing") for key in stopped), check["alert_series"]


def test_every_request_completes_through_the_pause(check):
    pause = check["pause_load"]
    assert pause["error"] is None and pause["wrong"] == [], pause
    assert pause["completed"] == pause["sent"]


def test_prometheus_was_stopped_by_its_sigterm(check):
    assert check["prometheus_stop"]["killed"] is False, check["prometheus_stop"]
