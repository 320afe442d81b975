"""What a real server says: its activation and periodic stats lines, and its /metrics samples."""

from __future__ import annotations

import re

# ------------------------------------------------------------------------ log lines
ACTIVATION = re.compile(
    r"balance scheduling active: DP(?P<rank>\d+) of DP=(?P<dp>\d+), MoE, path=(?P<path>[\w-]+), "
    r"scheduler=(?P<scheduler>\w+), engine core=(?P<engine_core>\w+)"
)
STATS = re.compile(
    r"Balance DP(?P<rank>\d+): steps=(?P<steps>\d+), frozen=(?P<frozen>[\d.]+)%, "
    r"deferred admissions=(?P<deferred>\d+), released=(?P<released>\d+)"
    r".*, gather blocked=(?P<blocked>\d+)"
)


def activation_lines(log: str) -> list[dict]:
    return [m.groupdict() for m in ACTIVATION.finditer(log)]


def stats_lines_per_rank(log: str) -> dict[int, list[dict]]:
    """Every periodic stats line of each DP rank, in log order (counters are cumulative)."""
    lines: dict[int, list[dict]] = {}
    for match in STATS.finditer(log):
        values = match.groupdict()
        lines.setdefault(int(values["rank"]), []).append(
            {
                "steps": int(values["steps"]),
                "frozen_pct": float(values["frozen"]),
                "deferred": int(values["deferred"]),
                "released": int(values["released"]),
                "blocked": int(values["blocked"]),
            }
        )
    return lines


def last_stats_per_rank(log: str) -> dict[int, dict]:
    """The last periodic stats line of each DP rank."""
    return {rank: lines[-1] for rank, lines in stats_lines_per_rank(log).items()}


# ------------------------------------------------------------------------ /metrics
BALANCE_PREFIX = "vllm:balance_"


def metric_samples(metrics_text: str, prefix: str) -> list:
    """The samples whose name starts with ``prefix``, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        sample
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name.startswith(prefix)
    ]


def balance_metrics_per_engine(metrics_text: str) -> dict[int, dict[str, float]]:
    """``{engine: {name without "vllm:balance_": value}}`` of the scraped balance samples."""
    engines: dict[int, dict[str, float]] = {}
    for sample in metric_samples(metrics_text, BALANCE_PREFIX):
        name = sample.name.removeprefix(BALANCE_PREFIX)
        engines.setdefault(int(sample.labels["engine"]), {})[name] = sample.value
    return engines


def metrics_as_log_lines(metrics_text: str) -> dict[int, dict]:
    """Each engine's scraped balance counters in its stats line's terms (``stats_lines_per_rank``).

    After each publish a rank's counters on /metrics equal that moment's log line, so a scrape
    must equal one of the rank's lines.
    """
    as_logged = {}
    for engine, values in balance_metrics_per_engine(metrics_text).items():
        steps, frozen = values["steps_total"], values["frozen_steps_total"]
        as_logged[engine] = {
            "steps": steps,
            "frozen_pct": float(f"{100 * frozen / steps:.1f}") if steps else 0.0,
            "deferred": values["deferred_admissions_total"],
            "released": values["released_steps_total"],
            "blocked": values["gather_blocked_total"],
        }
    return as_logged
