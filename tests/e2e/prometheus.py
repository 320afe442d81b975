"""A real Prometheus, started by a test on loopback, scraping a real server's ``/metrics``.

``PrometheusServer`` writes a config (one scrape job: the server; the rules file it is given),
runs Debian's ``prometheus`` binary (``tools/prometheus_binaries.py``) with its storage under the
test's directory, for at most ``MAX_RUN_S``, waits for ``/-/ready``, and is stopped by PID
(SIGTERM, then SIGKILL after a bound) when the ``with`` block ends, whatever happened in it.
``query`` and ``alerts`` read its HTTP API, as Grafana and an operator's alertmanager do.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from vllm.utils.network_utils import get_open_port

from balance_testbed.waiting import wait_for
from tests.monitoring import binary

# Seconds between scrapes and between rule evaluations: a few samples per second of the test.
SCRAPE_S = 1.0
READY_TIMEOUT_S = 60.0
# No Prometheus outlives its test by more than this, even where the test process dies first
# (coreutils timeout runs it and forwards the stop's SIGTERM).
MAX_RUN_S = 1800
STOP_TIMEOUT_S = 15.0


class PrometheusError(RuntimeError):
    """Prometheus did not start, or an API call failed; the message has its log tail."""


class PrometheusServer:
    """``with PrometheusServer(workdir, target, rules) as prom:`` scrapes ``target``
    (host:port) every ``SCRAPE_S`` and evaluates ``rules`` (a rules file's text)."""

    def __init__(self, workdir: Path, target: str, rules: str) -> None:
        self.workdir = workdir
        self.target = target
        self.rules = rules
        self.port = 0
        self.process: subprocess.Popen | None = None
        self.log_path = workdir / "prometheus.log"
        self.stopped: dict = {}

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "rules.yml").write_text(self.rules)
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_S:g}s",
                "evaluation_interval": f"{SCRAPE_S:g}s",
            },
            "rule_files": [str(self.workdir / "rules.yml")],
            "scrape_configs": [
                {"job_name": "vllm", "static_configs": [{"targets": [self.target]}]}
            ],
        }
        (self.workdir / "prometheus.yml").write_text(json.dumps(config, indent=1))  # YAML 1.2
        self.port = get_open_port()
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child holds it; closed below)
        try:
            self.process = subprocess.Popen(
                [
                    "timeout",
                    f"--kill-after={STOP_TIMEOUT_S:.0f}",
                    str(MAX_RUN_S),
                    str(binary("prometheus")),
                    f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    "--storage.tsdb.retention.time=1h",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        if wait_for(self._ready, READY_TIMEOUT_S, 0.5) is None:
            self.stop()
            raise PrometheusError(
                f"prometheus not ready after {READY_TIMEOUT_S:.0f} s\n{self.log_tail()}"
            )

    def _ready(self) -> bool:
        """Whether ``/-/ready`` answers 200; raises once Prometheus has exited."""
        if self.process.poll() is not None:
            raise PrometheusError(
                f"prometheus exited with {self.process.returncode}\n{self.log_tail()}"
            )
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> dict:
        """SIGTERM by PID, SIGKILL after ``STOP_TIMEOUT_S``; what it took, kept in ``stopped``."""
        if self.process is None or self.stopped:
            return self.stopped
        began = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
            killed = False
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)
            killed = True
        self.stopped = {
            "killed": killed,
            "returncode": self.process.returncode,
            "seconds": round(time.monotonic() - began, 1),
        }
        return self.stopped

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as response:
                answer = json.load(response)
        except OSError as exc:
            raise PrometheusError(f"GET /api/v1/{path}{query}: {exc}\n{self.log_tail()}") from exc
        if answer.get("status") != "success":
            raise PrometheusError(f"GET /api/v1/{path}{query}: {answer}")
        return answer["data"]

    def query(self, expr: str, at: float | None = None) -> dict[str, float]:
        """An instant query's value per engine (``{engine: value}``), at ``at`` (unix time)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        result = self.api("query", **params)["result"]
        return {s["metric"].get("engine", ""): float(s["value"][1]) for s in result}

    def samples(self, name: str, seconds: int) -> dict[str, list[tuple[float, float]]]:
        """The raw samples of ``name`` in the last ``seconds``, per engine: (time, value)."""
        result = self.api("query", query=f"{name}[{seconds}s]")["result"]
        return {
            s["metric"].get("engine", ""): [(float(t), float(v)) for t, v in s["values"]]
            for s in result
        }

    def alerts(self) -> list[dict]:
        """Pending and firing alerts: ``{"name", "engine", "state"}``."""
        return [
            {
                "name": a["labels"]["alertname"],
                "engine": a["labels"].get("engine"),
                "state": a["state"],
            }
            for a in self.api("alerts")["alerts"]
        ]

    def wait_for_scrapes(self, count: int, timeout_s: float = 60.0) -> None:
        """Until ``count`` successful scrapes of the target are stored."""

        def stored() -> bool:
            scrapes = self.samples("up", 600).get("", [])
            return sum(value == 1 for _, value in scrapes) >= count

        if wait_for(stored, timeout_s, SCRAPE_S) is None:
            raise PrometheusError(f"fewer than {count} scrapes of {self.target}\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])
