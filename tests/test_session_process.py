"""The life-cycle the real server and the Ray cluster share (``balance_testbed.session_process``),
on children that take a second, not minutes: what SIGTERM does not end is found and killed by
PID, a process that left the session included, and a failed start-up still stops the child."""

from __future__ import annotations

import os
import sys

import pytest

from balance_testbed.session_process import ServerError, SessionProcess
from balance_testbed.waiting import wait_for

pytestmark = pytest.mark.path_independent

# A grandchild that ignores SIGTERM (as a stuck engine core would) and says when it is up.
STUBBORN = (
    "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(float(sys.argv[1])); os.setsid(); time.sleep(60)"
)


def spawning(grandchild: str, *args: str) -> str:
    """A child that starts ``grandchild`` and sleeps (SIGTERM ends the child itself)."""
    argv = [sys.executable, "-c", grandchild, *args]
    return f"import subprocess, time; subprocess.Popen({argv!r}); time.sleep(60)"


class Child(SessionProcess):
    label = "child"

    def __init__(self, workdir, code: str, ready_s: float = 30.0) -> None:
        super().__init__(workdir, workdir / "child.log")
        self.code = code
        self.ready_s = ready_s
        self.after_stops = 0

    def start(self) -> None:
        self.launch([sys.executable, "-c", self.code], dict(os.environ))

    def wait_ready(self) -> None:
        if not self.poll_until_ready(lambda: "up" in self.log_text(), self.ready_s, poll_s=0.05):
            raise ServerError(f"child not up after {self.ready_s} s")

    def after_stop(self) -> None:
        self.after_stops += 1


def test_sigterm_that_ends_the_session_is_a_clean_stop(tmp_path):
    with Child(tmp_path, "import time; print('up', flush=True); time.sleep(60)") as child:
        assert child.live_pids() == [child.pid]
    assert child.stop_report["clean"] and child.stop_report["killed"] == []
    assert child.stop_report["returncode"] == -15 and child.leftovers() == []
    assert child.stop() is child.stop_report and child.after_stops == 1


def test_what_survives_sigterm_is_killed_by_pid_even_after_leaving_the_session(tmp_path):
    child = Child(tmp_path, spawning(STUBBORN, "1"))
    child.start()
    child.wait_ready()
    [grandchild] = [pid for pid in child.note_processes() if pid != child.pid]
    wait_for(lambda: os.getsid(grandchild) != child.pid, 20, 0.1)
    assert os.getsid(grandchild) == grandchild  # its own session now, still ours
    report = child.stop(timeout_s=1)
    assert not report["clean"] and report["returncode"] == -15
    assert [entry.split()[0] for entry in report["killed"]] == [str(grandchild)], report
    assert child.leftovers() == [] and child.after_stops == 1


def test_a_child_that_exits_during_start_up_fails_the_start_and_is_stopped(tmp_path):
    child = Child(tmp_path, "import sys; print('bad flag'); sys.exit(3)")
    with pytest.raises(ServerError, match="child exited with 3 during start-up\nbad flag"):
        with child:
            pass
    assert child.stop_report["returncode"] == 3 and child.after_stops == 1


def test_a_child_never_ready_is_stopped_after_its_bound(tmp_path):
    child = Child(tmp_path, "import time; time.sleep(60)", ready_s=0.5)
    with pytest.raises(ServerError, match="not up after 0.5 s"):
        with child:
            pass
    assert child.stop_report["clean"] and child.stop_report["returncode"] == -15
    assert child.leftovers() == []
