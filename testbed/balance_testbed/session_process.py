"""A child command in its own session, stopped by PID: the life-cycle every long-lived process
of the e2e tests shares (the vLLM server, ``balance_testbed.server``; the local Ray cluster,
``tests/e2e/ray_backend.py``).

Why a session of its own: whatever the child spawns (vLLM's engine cores and workers, Ray's
raylet and actors, multiprocessing's resource tracker) inherits it, so every descendant is found
by session id, without trusting a process group or a name. Each one seen is kept (a
``psutil.Process``, which holds its start time): one that later leaves the session is still ours,
and a PID the kernel has reused for another process is not. The stop is an operator's: SIGTERM to
the child, a bounded wait for its whole session, then SIGKILL by PID of what is left, reported in
``stop_report``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil

from balance_testbed.waiting import wait_for

# vLLM's own graceful shutdown takes a few seconds (``ray start``'s too); after this the rest of
# the session is SIGKILLed.
STOP_TIMEOUT_S = 30.0
_Self = TypeVar("_Self", bound="SessionProcess")  # typing.Self is 3.11+


class ServerError(RuntimeError):
    """The server died, did not come up in time, or would not stop; the message has its log tail."""


def process_name(pid: int) -> str:
    """vLLM's process title ("VLLM::EngineCore_DP0", ...) or the command line's start."""
    try:
        return " ".join(psutil.Process(pid).cmdline()).strip()[:80]
    except psutil.Error:
        return "?"


def session_pids(sid: int) -> list[int]:
    """Every process of session ``sid`` (zombies included)."""
    pids = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                pids.append(pid)
        except OSError:
            continue
    return sorted(pids)


def identity(pid: int) -> psutil.Process | None:
    """The process now at ``pid``; psutil keeps its start time, so a PID the kernel reuses for
    another process is not mistaken for ours (``running``)."""
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def running(process: psutil.Process) -> bool:
    """The very process ``process`` names is still running (a zombie is done running)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class SessionProcess:
    """One child in its own session; use as a context manager (it always stops, even when a
    test fails or the start-up does).

    A subclass says what to run and when it is up: ``start()`` calls ``launch(argv, env)``,
    ``wait_ready()`` polls with ``poll_until_ready``. ``label`` names the child in messages.
    """

    label = "process"

    def __init__(self, workdir: Path, log_path: Path) -> None:
        self.workdir = workdir
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.seen: dict[int, psutil.Process] = {}  # every process seen, by PID (start time kept)
        self.stop_report: dict = {}

    # ------------------------------------------------------------------ life cycle
    def __enter__(self: _Self) -> _Self:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        raise NotImplementedError

    def wait_ready(self) -> object:
        raise NotImplementedError

    def launch(self, argv: list[str], env: dict[str, str]) -> None:
        """Run ``argv`` in ``workdir``, its own session, its output appended to ``log_path``."""
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child holds it; closed below)
        try:
            self.process = subprocess.Popen(
                argv,
                env=env,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own session: every descendant is findable by sid
            )
        finally:
            log.close()
        self._started_at = time.monotonic()

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.label} not started"
        return self.process.pid

    def poll_until_ready(self, ready: Callable[[], bool], timeout_s: float, poll_s: float) -> bool:
        """Whether ``ready()`` held within ``timeout_s`` of the start, polled every ``poll_s``.

        Notes the session's processes on each poll (one that leaves the session early stays
        ours). Raises ServerError when the child exits first: waiting longer cannot help.
        """

        def alive_and_ready() -> bool:
            self.note_processes()
            if self.process.poll() is not None:
                raise ServerError(
                    f"{self.label} exited with {self.process.returncode} during start-up\n"
                    f"{self.log_tail()}"
                )
            return ready()

        left_s = self._started_at + timeout_s - time.monotonic()
        return wait_for(alive_and_ready, left_s, poll_s) is not None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> dict:
        """SIGTERM the child, wait for its whole session, SIGKILL what is left (by PID).

        Returns (and keeps as ``stop_report``): whether the session ended by itself within the
        bound after SIGTERM, the child's exit status, and the processes that had to be killed.
        Only the first call stops; later ones return the same report.
        """
        if self.process is None or self.stop_report:
            return self.stop_report
        self.note_processes()
        began = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        clean = self._wait_session_gone(timeout_s)
        killed = [] if clean else self.kill_all()
        self.stop_report = {
            "clean": clean,
            "returncode": self.process.poll(),
            "seconds": round(time.monotonic() - began, 1),
            "killed": killed,
        }
        self.after_stop()
        return self.stop_report

    def after_stop(self) -> None:
        """A subclass's clean-up once its session is gone (run by the stopping ``stop()``)."""

    def kill_all(self) -> list[str]:
        """SIGKILL every live process of the session, each by PID; returns what it killed."""
        killed = []
        for pid in sorted(self.live_pids()):
            name = process_name(pid)
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(f"{pid} {name}")
            except ProcessLookupError:
                pass
        if self.process is not None:
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        self._wait_session_gone(STOP_TIMEOUT_S)
        return killed

    def _wait_session_gone(self, timeout_s: float) -> bool:
        def gone() -> bool:
            return self.process.poll() is not None and not self.live_pids()

        return wait_for(gone, timeout_s, 0.5) is not None

    # ------------------------------------------------------------------ processes
    def note_processes(self) -> list[int]:
        """Record the session's processes now (one that later leaves the session stays ours)."""
        current = session_pids(self.pid)
        for pid in current:
            known = self.seen.get(pid)
            if known is None or not running(known):  # new, or a PID reused since
                process = identity(pid)
                if process is not None:
                    self.seen[pid] = process
        return current

    def live_pids(self) -> list[int]:
        """Processes of this child still running: its session now, plus every one ever seen."""
        self.note_processes()
        return sorted(pid for pid, process in self.seen.items() if running(process))

    def leftovers(self) -> list[str]:
        """Orphan check: anything of this child still alive after ``stop()``."""
        return [f"{pid} {process_name(pid)}" for pid in self.live_pids()]

    def pids_named(self, title_prefix: str) -> list[int]:
        """Live processes whose title starts with ``title_prefix`` (e.g. "VLLM::EngineCore")."""
        return [p for p in self.note_processes() if process_name(p).startswith(title_prefix)]

    # ------------------------------------------------------------------ log
    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])
