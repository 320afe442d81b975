"""Every rank's balance counters on the API server's /metrics, carried in vLLM's SchedulerStats.

Each link of the route on the pinned release's real objects: a balance scheduler's
``make_stats()`` carries what the periodic log published (``shim/metrics.py``); vLLM's own
msgpack encoder and the API server's ``EngineCoreOutputs`` decoder carry the field across the
process boundary once the plugin has run (a child process each: msgspec reads a Struct's field
types at its first decoder); vLLM's ``StatLoggerManager`` hands the stats to the stat-logger
plugin, whose counters vLLM's ``/metrics`` registry then serves. The two-host server's scrape is
``tests/e2e/test_multinode.py``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import fields

import pytest
from conftest import ROOT
from vllm.v1.metrics.stats import SchedulerStats

import vllm_balance
from balance_testbed.factories import make_scheduler, make_vllm_config
from vllm_balance.config import METRICS_ENV_VAR
from vllm_balance.log import LOGGER_NAME
from vllm_balance.shim.metrics import (
    COUNTERS,
    GAP_GAUGE,
    BalanceSchedulerStats,
    BalanceStatLogger,
    export_status,
)

BALANCE_ON = {"enable_balance_scheduling": True}
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def dp_config():
    return make_vllm_config(data_parallel_size=2, additional_config=BALANCE_ON)


def balance_scheduler(log_stats: bool = True):
    return make_scheduler(vllm_balance.BalanceScheduler, dp_config(), log_stats=log_stats)


def count_steps(scheduler, counts: list[int], frozen: bool, waiting: int) -> None:
    """What one gather and one ``schedule()`` record (the gate's own tests cover the gate)."""
    scheduler.balance_gate.stats.record_gather(counts)
    scheduler.balance_gate.stats.record_step(frozen, False, waiting, 0)


def vllm_fields(stats) -> dict:
    return {f.name: getattr(stats, f.name) for f in fields(SchedulerStats)}


def test_make_stats_carries_the_published_increases_once_then_is_upstreams():
    """Steps between publishes return upstream's stats as they are; no instance attribute
    stands in for the method."""
    scheduler = balance_scheduler()
    assert "make_stats" not in vars(scheduler)
    assert type(scheduler.make_stats()) is SchedulerStats  # nothing published yet
    count_steps(scheduler, [4, 1], frozen=True, waiting=3)
    scheduler.balance_gate.metrics.publish(scheduler.balance_gate.stats)  # as each log line does
    carried = scheduler.make_stats()
    assert isinstance(carried, BalanceSchedulerStats)
    assert carried.balance["balance_steps"] == 1
    assert carried.balance["balance_deferred_admissions"] == 3
    assert carried.balance[GAP_GAUGE[0]] == 3
    assert set(carried.balance) == {name for name, _, _ in COUNTERS} | {GAP_GAUGE[0]}
    assert "make_stats" not in vars(scheduler)
    assert type(scheduler.make_stats()) is SchedulerStats  # delivered once
    count_steps(scheduler, [4, 2], frozen=True, waiting=2)
    count_steps(scheduler, [3, 2], frozen=False, waiting=0)
    scheduler.balance_gate.stats.blocked_gathers += 1  # what the watchdog thread counts
    scheduler.balance_gate.metrics.publish(scheduler.balance_gate.stats)
    second = scheduler.make_stats().balance
    # Only what was counted since the first publish: the API server adds them up.
    assert (second["balance_steps"], second["balance_frozen_steps"]) == (2, 1)
    assert (second["balance_deferred_admissions"], second["balance_gathers"]) == (2, 2)
    assert (second["balance_gather_blocked"], second[GAP_GAUGE[0]]) == (1, 1)


def test_carried_stats_hold_vllms_own_values_unchanged():
    carrying, plain = balance_scheduler(), make_scheduler(vllm_config=dp_config(), log_stats=True)
    carrying.balance_gate.metrics.publish(carrying.balance_gate.stats)
    carried = carrying.make_stats()
    assert isinstance(carried, BalanceSchedulerStats)
    assert vllm_fields(carried) == vllm_fields(plain.make_stats())


def test_without_vllm_stats_nothing_is_carried_and_the_increases_add_up():
    scheduler = balance_scheduler(log_stats=False)
    count_steps(scheduler, [4, 1], frozen=True, waiting=3)
    scheduler.balance_gate.metrics.publish(scheduler.balance_gate.stats)
    assert scheduler.make_stats() is None
    count_steps(scheduler, [4, 1], frozen=True, waiting=3)
    scheduler.balance_gate.metrics.publish(scheduler.balance_gate.stats)
    assert scheduler.balance_gate.metrics.pending["balance_steps"] == 2
    assert "--disable-log-stats" in export_status(log_stats=False)


# A child process: an engine core's outputs through vLLM's encoder and the API server's decoder
# (built after the plugin ran, as vLLM's client is); prints what the API server got.
WIRE = textwrap.dedent(
    """
    import json, sys
    if sys.argv[1] == "plugin":
        from vllm_balance import plugin
        plugin.register()
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    from vllm_balance.shim.metrics import BalanceSchedulerStats

    decoder = MsgpackDecoder(EngineCoreOutputs)
    sent = BalanceSchedulerStats(num_running_reqs=3, balance={"balance_steps": 5.0})
    frames = MsgpackEncoder().encode(EngineCoreOutputs(engine_index=1, scheduler_stats=sent))
    got = decoder.decode(frames).scheduler_stats
    print(json.dumps([got.num_running_reqs, getattr(got, "balance", "dropped")]))
    """
)


def decoded_by_the_api_server(mode: str, metrics_env: str | None = "1") -> list:
    env = {k: v for k, v in os.environ.items() if k != METRICS_ENV_VAR}
    if metrics_env is not None:
        env[METRICS_ENV_VAR] = metrics_env
    result = subprocess.run(
        [sys.executable, "-c", WIRE, mode], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.path_independent  # the API server's side
def test_the_api_servers_decoder_keeps_the_balance_field_once_the_plugin_ran():
    assert decoded_by_the_api_server("plugin") == [3, {"balance_steps": 5.0}]


@pytest.mark.path_independent  # the API server's side
def test_without_the_decode_patch_vllms_decoder_drops_the_field():
    """Why the registry's STATS_DECODED_WITH_BALANCE exists (negative control)."""
    assert decoded_by_the_api_server("no-plugin") == [3, "dropped"]


@pytest.mark.path_independent  # the API server's side
def test_without_the_metrics_env_var_the_plugin_leaves_the_decoder_upstreams():
    """Balance off is the default: the plugin changes no vLLM object but the engine-core wrapper
    (test_activation.py), so the decoder drops the field until the operator asks for it."""
    assert decoded_by_the_api_server("plugin", metrics_env=None) == [3, "dropped"]


def samples(registry, prefix: str) -> dict[tuple[str, frozenset], float]:
    """``{(name, labels): value}`` of the registry's samples starting with ``prefix``."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    }


def test_vllms_stat_logger_manager_serves_each_engines_counters_on_metrics():
    """The plugin as vLLM loads it (entry point), next to vLLM's Prometheus logger, which is
    built after it and unregisters every ``vllm:`` collector it finds then."""
    from vllm.v1.metrics.loggers import StatLoggerManager, load_stat_logger_plugin_factories
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    plugins = load_stat_logger_plugin_factories()
    assert BalanceStatLogger in plugins
    config = dp_config()
    manager = StatLoggerManager(config, engine_idxs=[0, 1], custom_stat_loggers=plugins)
    published = {}
    for engine, counts, waiting in ((0, [4, 1], 5), (1, [4, 1], 2), (1, [4, 3], 7)):
        scheduler = balance_scheduler()
        count_steps(scheduler, counts, frozen=True, waiting=waiting)
        scheduler.balance_gate.metrics.publish(scheduler.balance_gate.stats)
        stats = scheduler.make_stats()
        manager.record(scheduler_stats=stats, iteration_stats=None, engine_idx=engine)
        published.setdefault(engine, []).append(waiting)
    registry = get_prometheus_registry()
    ours = samples(registry, "vllm:balance_")
    model_name = config.model_config.served_model_name
    labels = {e: frozenset({"model_name": model_name, "engine": str(e)}.items()) for e in (0, 1)}
    for engine in (0, 1):
        key = ("vllm:balance_deferred_admissions_total", labels[engine])
        assert ours[key] == sum(published[engine]), ours
        assert ours[("vllm:balance_steps_total", labels[engine])] == len(published[engine])
    assert ours[("vllm:balance_running_gap", labels[1])] == 1  # the last message's gap
    vllms = {labels for _, labels in samples(registry, "vllm:num_requests_running")}
    assert {labels for _, labels in ours} == vllms == set(labels.values())


def test_an_engine_that_sends_stats_without_balance_counters_is_named_once(caplog):
    logger = BalanceStatLogger(dp_config(), [0, 1])
    logger.silent_after_s = 0.0
    scheduler = balance_scheduler()
    scheduler.balance_gate.metrics.publish(scheduler.balance_gate.stats)
    logger.record(scheduler.make_stats(), None, engine_idx=0)
    logger.record(SchedulerStats(), None, engine_idx=1)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        logger.log()
        logger.log()
    warnings = [r.getMessage() for r in caplog.records if "no balance counters" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("engine 1 "), warnings


# A child process stands in for one API server of several (--api-server-count): it records
# the increases it was sent into the shared multiprocess directory.
API_SERVER = textwrap.dedent(
    """
    import json, sys
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm_balance.shim.metrics import BalanceSchedulerStats, BalanceStatLogger
    from balance_testbed.factories import make_vllm_config

    config = make_vllm_config(data_parallel_size=2, additional_config=json.loads(sys.argv[2]))
    config.model_config.served_model_name = "tiny-moe"  # one label set for both API servers
    logger = BalanceStatLogger(config, [0])
    for increase in json.loads(sys.argv[1]):
        stats = BalanceSchedulerStats(balance={"balance_steps": increase})
        logger.record(stats, None, engine_idx=0)
    """
)


@pytest.mark.path_independent  # the API server's side
@pytest.mark.parametrize("split", [[[3, 4], [5]]], ids=["two-api-servers"])
def test_several_api_servers_add_up_the_increases(tmp_path, monkeypatch, split):
    """An engine's stats go to whichever API server has outputs that step: each adds what it got,
    and vLLM's multiprocess registry sums the API servers (totals on the wire would not add)."""
    env = {**os.environ, MULTIPROC_ENV: str(tmp_path)}
    for increases in split:
        done = subprocess.run(
            [sys.executable, "-c", API_SERVER, json.dumps(increases), json.dumps(BALANCE_ON)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    steps = {
        dict(labels)["engine"]: value
        for (name, labels), value in samples(get_prometheus_registry(), "vllm:balance_").items()
        if name == "vllm:balance_steps_total"
    }
    assert steps == {"0": sum(sum(part) for part in split)}
