"""Balance counters of every DP rank on the API server's ``/metrics``, carried in SchedulerStats.

Every engine core, on the head node or on a ``--headless`` node, already sends vLLM's
``SchedulerStats`` to the API server with its outputs; the API server's stat loggers turn them
into the per-engine ``vllm:*`` metrics. Balance rides along (docs/design.md, "Metrics for every
rank", weighs this against a per-node exporter):

- engine core: at each periodic log line, ``BalanceMetrics.publish()`` queues what the counters
  grew by since the previous line, and the balance scheduler's next ``make_stats()`` (an override
  in ``shim/scheduler.py``) hands the queue to vLLM as a ``BalanceSchedulerStats``: vLLM's class
  plus one field, ``balance``. Every other step returns upstream's stats as they are.
- API server: ``BalanceStatLogger``, a vLLM stat-logger plugin (entry point
  ``vllm.stat_logger_plugins``), adds each message's increases to counters labelled like vLLM's
  own per-engine metrics (``model_name``, ``engine``), so ``/metrics`` after a rank's message
  equals that rank's log line, whichever node the rank runs on.
- on the wire: msgspec decodes a dataclass by its declared fields and drops the rest, so the API
  server decodes ``EngineCoreOutputs.scheduler_stats`` as ``BalanceSchedulerStats``: a run-time
  patch (``vllm_balance.registry.STATS_DECODED_WITH_BALANCE``) installed by the plugin before vLLM
  builds its engine client, where ``VLLM_BALANCE_METRICS=1`` asks for it (the plugin cannot see
  the config there yet, and with balance off it changes no vLLM object). Without it the API
  server drops the field and says so once (``log_engine_initialized``).

Increases, not totals, travel: with several API servers (``--api-server-count``), an engine's
stats go to whichever one has outputs that step, and prometheus_client's multiprocess collector
adds up the API servers' counters. A rank stuck in a gather sends nothing until it returns: its
blocked gathers (counted by the watchdog thread into ``BalanceStats``) arrive with its next
message; while it waits, the watchdog's ERROR line is the signal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.loggers import AggregateStatLoggerBase
from vllm.v1.metrics.stats import SchedulerStats

from vllm_balance.config import DEFAULT_LOG_INTERVAL_S, ENABLE_KEY, METRICS_ENV_VAR, read_options
from vllm_balance.log import logger
from vllm_balance.shim.stats import BalanceStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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
    (
        "balance_gather_blocked",
        "blocked_gathers",
        "Gathers the gather watchdog reported blocked (waited over balance_gather_warn_s).",
    ),
)
GAP_GAUGE = (
    "balance_running_gap",
    "Largest minus smallest running count in the last published gather.",
)
# How many publish intervals the API server waits for an engine's first counters before it
# says that engine sends none (a node without the plugin, or with balance off).
SILENT_INTERVALS = 3


@dataclass
class BalanceSchedulerStats(SchedulerStats):
    """vLLM's ``SchedulerStats`` plus one rank's balance counters: ``{name: increase}``."""

    balance: dict[str, float] | None = None


class BalanceMetrics:
    """Engine side: one rank's counter increases waiting for its scheduler's next stats.

    The scheduler's ``make_stats()`` attaches ``pending`` where it is not empty (after a
    publish). Where vLLM collects no stats (``--disable-log-stats``: ``make_stats()`` returns
    None) nothing is attached and the queue keeps adding up.
    """

    def __init__(self) -> None:
        self._published: dict[str, float] = {}
        self.pending: dict[str, float] = {}

    def publish(self, stats: BalanceStats) -> None:
        """Queue what ``stats`` counted since the last publish, and the current gap."""
        pending = self.pending
        for name, field, _ in COUNTERS:
            value = getattr(stats, field)
            pending[name] = pending.get(name, 0) + value - self._published.get(field, 0)
            self._published[field] = value
        if stats.gathers:
            pending[GAP_GAUGE[0]] = stats.gathered_max - stats.gathered_min

    def attach(self, stats: SchedulerStats) -> BalanceSchedulerStats:
        """``stats`` as a ``BalanceSchedulerStats`` carrying the queue, which starts afresh."""
        values = {f.name: getattr(stats, f.name) for f in fields(stats)}
        carried = BalanceSchedulerStats(**values, balance=self.pending)
        self.pending = {}
        return carried


def export_status(log_stats: bool | None = None) -> str:
    """The activation log's second line: where this rank's balance metrics go."""
    if log_stats is False:
        return (
            "balance metrics not sent to the API server: this engine core collects no vLLM "
            "stats (--disable-log-stats), which carry them; the log line stays"
        )
    return (
        "balance metrics sent to the API server's /metrics (vllm:balance_*) with vLLM's "
        "SchedulerStats at each balance log interval"
    )


class BalanceStatLogger(AggregateStatLoggerBase):
    """API server side: the counters each engine's ``SchedulerStats`` carries, on ``/metrics``.

    The prometheus objects are made with the first counters that arrive, not in ``__init__``:
    vLLM builds its own Prometheus logger after the plugins' and unregisters every ``vllm:``
    collector it finds then.
    """

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int]) -> None:
        self.model_name = vllm_config.model_config.served_model_name
        self.engine_indexes = list(engine_indexes)
        options = read_options(vllm_config)
        self.expected = options is not None
        interval_s = options.log_interval_s if options is not None else None
        self.silent_after_s = SILENT_INTERVALS * (interval_s or DEFAULT_LOG_INTERVAL_S)
        self._families: dict[str, Any] | None = None
        self._engines: dict[int, dict[str, Any]] = {}
        # Engines that sent vLLM's stats but no balance counters yet: since when.
        self._silent_since: dict[int, float] = {}
        self._warned: set[int] = set()

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        balance = getattr(scheduler_stats, "balance", None)
        if balance is None:
            if self.expected and scheduler_stats is not None and engine_idx not in self._engines:
                self._silent_since.setdefault(engine_idx, time.monotonic())
            return
        children = self._engines.get(engine_idx) or self._add_engine(engine_idx)
        for name, value in balance.items():
            child = children.get(name)
            if child is None:  # a name this version does not know: a newer engine's
                continue
            if name == GAP_GAUGE[0]:
                child.set(value)
            elif value:
                child.inc(value)

    def _add_engine(self, engine: int) -> dict[str, Any]:
        if self._families is None:
            self._families = _families()
        labels = {"model_name": self.model_name, "engine": str(engine)}
        children = {name: family.labels(**labels) for name, family in self._families.items()}
        self._engines[engine] = children
        self._silent_since.pop(engine, None)
        return children

    def log(self) -> None:
        """Say once per engine that it sends vLLM's stats but no balance counters."""
        now = time.monotonic()
        for engine, since in self._silent_since.items():
            if engine not in self._warned and now - since > self.silent_after_s:
                self._warned.add(engine)
                logger.warning(
                    "engine %d has sent vLLM's stats for %.0f s but no balance counters: its "
                    "vllm:balance_* metrics stay absent. Check that node: "
                    "vllm-balance-scheduling installed, the same --additional-config "
                    "(%s) as this API server, and its plugin loaded (VLLM_PLUGINS)",
                    engine,
                    now - since,
                    ENABLE_KEY,
                )

    def log_engine_initialized(self) -> None:
        if not self.expected:
            return
        if not balance_field_decoded():
            logger.warning(
                "balance scheduling is on, but this API server drops the balance counters its "
                "engines send: set %s=1 on it for vllm:balance_* on /metrics (the per-rank log "
                "lines are unaffected)",
                METRICS_ENV_VAR,
            )
            return
        logger.info(
            "balance metrics: vllm:balance_* of engines %s on /metrics, from the counters "
            "their SchedulerStats carry",
            self.engine_indexes,
        )


def balance_field_decoded() -> bool:
    """Whether this process decodes ``EngineCoreOutputs.scheduler_stats`` with the balance field
    (the plugin's decode patch, installed only where ``VLLM_BALANCE_METRICS=1``)."""
    from vllm.v1.engine import EngineCoreOutputs

    decoded = EngineCoreOutputs.__dict__["__annotations__"].get("scheduler_stats")
    return BalanceSchedulerStats.__name__ in str(decoded)


# The balance families this process registered last: one set per process, as vLLM's.
_registered: list[Any] = []


def _families() -> dict[str, Any]:
    """The balance metric families in prometheus_client's default registry (vLLM's /metrics),
    replacing the set an earlier stat logger in this process registered."""
    from prometheus_client import REGISTRY, Counter, Gauge

    labels = ["model_name", "engine"]
    for collector in _registered:
        try:
            REGISTRY.unregister(collector)
        except KeyError:  # unregistered already: vLLM's Prometheus logger removes vllm:* ones
            pass
    families: dict[str, Any] = {
        name: Counter(f"vllm:{name}", documentation, labels) for name, _, documentation in COUNTERS
    }
    families[GAP_GAUGE[0]] = Gauge(
        f"vllm:{GAP_GAUGE[0]}",
        GAP_GAUGE[1],
        labels,
        multiprocess_mode="mostrecent",  # as vLLM's own per-engine gauges
    )
    _registered[:] = families.values()
    return families
