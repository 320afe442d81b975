"""Balance metrics through prometheus_client's multiprocess files, as vLLM's /metrics reads them.

Each export runs in a child process started with ``PROMETHEUS_MULTIPROC_DIR`` set (the engine
core's situation: prometheus_client picks its value store at import); this process reads the
directory through the installed vLLM's own ``get_prometheus_registry()``, the registry its
``/metrics`` serves, so each pinned release's session checks that vLLM reads them. The real
server's scrape is tests/e2e/test_server.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ENV = "PROMETHEUS_MULTIPROC_DIR"

# Two publishes with steps between them, then a blocked gather; prints the stats it published.
EXPORT = textwrap.dedent(
    """
    import json
    from vllm_balance.shim.metrics import BalanceMetrics, export_status
    from vllm_balance.shim.stats import BalanceStats

    print(export_status(), flush=True)
    metrics, stats = BalanceMetrics("tiny-moe", 1), BalanceStats()
    stats.record_gather([4, 1])
    stats.record_step(frozen=True, released=False, num_waiting=3, dp_rank=1)
    metrics.publish(stats)
    stats.record_gather([4, 2])
    stats.record_step(frozen=True, released=False, num_waiting=2, dp_rank=1)
    stats.record_step(frozen=False, released=True, num_waiting=0, dp_rank=1)
    stats.gather_seconds = 0.25
    metrics.publish(stats)
    metrics.count_blocked_gather()
    print(json.dumps(stats.__dict__, default=str))
    """
)


def run_child(script: str, env: dict[str, str]) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def collected(directory: str, monkeypatch) -> dict[str, tuple[dict[str, str], float]]:
    """What the installed vLLM's /metrics registry serves from ``directory``."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    monkeypatch.setenv(ENV, directory)
    registry = get_prometheus_registry()
    return {
        sample.name: (sample.labels, sample.value)
        for family in registry.collect()
        for sample in family.samples
    }


def test_published_counters_equal_the_stats_with_vllms_engine_labels(tmp_path, monkeypatch):
    lines = run_child(EXPORT, {ENV: str(tmp_path)})
    stats = json.loads(lines[-1])
    samples = {
        name: sample
        for name, sample in collected(str(tmp_path), monkeypatch).items()
        if name.startswith("vllm:balance_")
    }
    assert any(line.startswith("balance metrics exported on /metrics") for line in lines[:-1])
    assert {labels["engine"] for labels, _ in samples.values()} == {"1"}
    assert {labels["model_name"] for labels, _ in samples.values()} == {"tiny-moe"}
    values = {name: value for name, (_, value) in samples.items()}
    # The second publish added only what was counted since the first.
    assert values == {
        "vllm:balance_steps_total": stats["steps"],
        "vllm:balance_frozen_steps_total": stats["frozen_steps"],
        "vllm:balance_deferred_admissions_total": stats["deferred_admissions"],
        "vllm:balance_released_steps_total": stats["released_steps"],
        "vllm:balance_gathers_total": stats["gathers"],
        "vllm:balance_gather_seconds_total": stats["gather_seconds"],
        "vllm:balance_gather_blocked_total": 1,
        "vllm:balance_running_gap": 4 - 2,
    }
    assert (stats["steps"], stats["frozen_steps"], stats["deferred_admissions"]) == (3, 2, 5)


def test_no_export_without_the_directory_and_the_log_says_why(tmp_path):
    script = "from vllm_balance.shim.metrics import export_status; print(export_status())"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert "balance metrics not exported on /metrics: PROMETHEUS_MULTIPROC_DIR is not set" in (
        result.stdout
    )


def test_no_export_where_prometheus_client_was_imported_before_the_directory_was_set(tmp_path):
    """A process forked from a parent that set the variable only after importing the client."""
    script = textwrap.dedent(
        f"""
        import os, prometheus_client
        os.environ[{ENV!r}] = {str(tmp_path)!r}
        from vllm_balance.shim.metrics import export_status
        print(export_status())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != ENV}
    (status,) = [
        line
        for line in subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        ).stdout.splitlines()
        if line.startswith("balance metrics")
    ]
    assert "prometheus_client was imported in this process before" in status
