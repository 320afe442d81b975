"""Balance counters on vLLM's Prometheus ``/metrics``, written by the engine core that counts them.

The mechanism is prometheus_client's multiprocess mode, which vLLM's ``/metrics`` already
serves: with ``PROMETHEUS_MULTIPROC_DIR`` set, the API server answers ``/metrics`` from a
``MultiProcessCollector`` over that directory (``vllm.v1.metrics.prometheus``), and a metric
created in any process of the server writes its values to a memory-mapped file there. The
engine core's counters therefore reach ``/metrics`` without a message: nothing per step leaves
the engine-core process beyond what vLLM already ships. The other route, a stat-logger plugin
(``vllm.stat_logger_plugins``) fed by ``SchedulerStats``, would need a field ``SchedulerStats``
does not have, i.e. more bytes shipped per step.

vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` itself only for ``--api-server-count`` > 1, and after
importing prometheus_client (an engine core forked from there keeps the in-memory store); the
operator sets it before starting the server (docs/operations.md, "Metrics on /metrics").
Otherwise nothing is exported and the activation log says why (``export_status``); the periodic
log line stays either way.

Cost: ``publish()`` runs with the periodic log line (every ``balance_log_interval_s``), not per
step, and writes the deltas of ``BalanceStats``' cumulative counters, so after each publish the
exported values equal that moment's log line. Only a blocked gather is written when it happens
(``count_blocked_gather``, from the watchdog thread): the rank's scheduler is stuck in that
gather and publishes nothing until it returns.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_balance.shim.stats import BalanceStats

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# name (without "vllm:" and the "_total" prometheus_client adds), BalanceStats field, help text.
COUNTERS = (
    ("balance_steps", "steps", "schedule() calls with balance scheduling enabled."),
    ("balance_frozen_steps", "frozen_steps", "Steps whose WAITING admission was frozen."),
    (
        "balance_deferred_admissions",
        "deferred_admissions",
        "WAITING requests held back: the waiting-queue length on each frozen step, summed.",
    ),
    (
        "balance_released_steps",
        "released_steps",
        "Frozen steps opened by the bounded hold (balance_max_frozen_steps).",
    ),
    (
        "balance_gathers",
        "gathers",
        "Exchanges of the running counts across the DP group (all_gather or the reduction).",
    ),
    (
        "balance_gather_seconds",
        "gather_seconds",
        "Seconds spent in those all-gathers (waiting for the slowest rank included).",
    ),
)
BLOCKED_COUNTER = (
    "balance_gather_blocked",
    "Gathers the gather watchdog reported blocked (waited over balance_gather_warn_s).",
)
GAP_GAUGE = (
    "balance_running_gap",
    "Largest minus smallest running count in the last published gather.",
)


class BalanceMetrics:
    """One rank's balance metrics, labelled like vLLM's per-engine ones (model_name, engine)."""

    def __init__(self, model_name: str, engine: int) -> None:
        from prometheus_client import Counter, Gauge

        labels = {"model_name": model_name, "engine": str(engine)}

        # registry=None: nothing scrapes this process's registry; the values go to the
        # multiprocess directory, which the API server's collector reads.
        def counter(name: str, documentation: str) -> Any:
            metric = Counter(f"vllm:{name}", documentation, list(labels), registry=None)
            return metric.labels(**labels)

        self._counters = [(field, counter(name, doc)) for name, field, doc in COUNTERS]
        self._blocked = counter(*BLOCKED_COUNTER)
        gap = Gauge(
            f"vllm:{GAP_GAUGE[0]}",
            GAP_GAUGE[1],
            list(labels),
            registry=None,
            multiprocess_mode="mostrecent",  # as vLLM's own per-engine gauges
        )
        self._gap = gap.labels(**labels)
        self._published: dict[str, float] = {}

    def publish(self, stats: BalanceStats) -> None:
        """Add what ``stats`` counted since the last publish; set the gap gauge."""
        for field, child in self._counters:
            value = getattr(stats, field)
            delta = value - self._published.get(field, 0)
            if delta:
                child.inc(delta)
                self._published[field] = value
        if stats.gathers:
            self._gap.set(stats.gathered_max - stats.gathered_min)

    def count_blocked_gather(self) -> None:
        self._blocked.inc()


def multiprocess_refusal() -> str | None:
    """Why this process cannot export to vLLM's /metrics; None when it can."""
    if not os.environ.get(MULTIPROC_DIR_ENV):
        return (
            f"{MULTIPROC_DIR_ENV} is not set, so the API server's /metrics reads only its own "
            "process (vLLM sets it only for --api-server-count > 1; set it to an empty "
            "directory before starting the server to export them)"
        )
    from prometheus_client import values

    # prometheus_client picks its value store once, at import: a process forked from a parent
    # that imported it before the variable was set keeps the in-memory store.
    if values.ValueClass is values.MutexValue:
        return (
            f"prometheus_client was imported in this process before {MULTIPROC_DIR_ENV} was "
            "set (set it in the environment that starts the server)"
        )
    return None


def export_status() -> str:
    """The activation log's second line: whether balance metrics reach /metrics, and why not."""
    refusal = multiprocess_refusal()
    if refusal is not None:
        return f"balance metrics not exported on /metrics: {refusal}"
    return f"balance metrics exported on /metrics (vllm:balance_*) via {MULTIPROC_DIR_ENV}"


def balance_metrics(vllm_config: Any, dp_rank: int) -> BalanceMetrics | None:
    """This rank's metrics when the process can export them (``export_status()`` says why not)."""
    if multiprocess_refusal() is not None:
        return None
    return BalanceMetrics(vllm_config.model_config.served_model_name, dp_rank)
