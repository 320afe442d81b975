"""The real DP=2 server on vLLM's Ray DP backend (``--data-parallel-backend ray``), on loopback.

A local Ray cluster is started as an operator would (``ray start --head --block``), on loopback:
node address 127.0.0.1, and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's own single-machine
mode, without which Ray turns 127.0.0.1 into the machine's own address when it connects. ``HOME``
(Ray writes its auth token to ``~/.ray``; vLLM its config to ``~/.config/vllm``) lies under the
test's tmp; Ray's temp directory is a fresh one in /tmp (Ray refuses one inside the virtualenv,
where nox keeps the test's tmp and TMPDIR, and its socket paths must stay short), its logs copied
to the test's tmp and the rest removed at the stop. It runs in its own session and is stopped by
PID (SIGTERM to ``ray start``, which stops what it started; then anything of the session left is
SIGKILLed). The API server connects to it through ``RAY_ADDRESS``; vLLM's ``CoreEngineActorManager``
builds the DP engine cores as Ray actors (workers too: the Ray executor), whose output Ray
forwards to the API server's log.

vLLM's CPU platform names no Ray device key: ``tests/e2e/ray_site/sitecustomize.py`` gives it one
in every process of the cluster (``GPU``, logical: ``ray start --num-gpus``), balance off too.

``RayRunCache.get(mode)``: the one-host rows' load and probes (``tests/e2e/runs.py``) on that
server, once per mode and session; the tests are ``tests/e2e/test_ray.py``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from vllm.utils.network_utils import get_open_port
from vllm_balance_e2e_plugins.step_timing import STEP_DIR_ENV

from balance_testbed.server import ServerError, VllmServer
from balance_testbed.session_process import SessionProcess
from tests.e2e.multinode import step_records
from tests.e2e.ray_site.sitecustomize import RAY_DEVICE_KEY_ENV
from tests.e2e.runs import (
    MODES,
    ROOT,
    Mode,
    RunCache,
    ServerRun,
    probe_after_the_load,
    serve_the_load,
)

LOOPBACK = "127.0.0.1"
DEVICE_KEY = "GPU"
# Ray slots: one device bundle per DP rank's worker, one CPU bundle per engine-core actor.
RAY_GPUS = 2
RAY_CPUS = 8
RAY_START_TIMEOUT_S = 120.0
RAY_MODES = {
    "ray-off": Mode("ray-off", seam=False, additional_config=None, path=None),
    "ray-on": Mode(
        "ray-on", seam=True, additional_config=MODES["shim"].additional_config, path="shim"
    ),  # fmt: skip
}


SITE = Path(__file__).with_name("ray_site")


def ray_env(home: Path) -> dict[str, str]:
    """What every Ray process (cluster, API server, actors) runs with: loopback, files in tmp,
    the CPU platform's Ray device key (``SITE``)."""
    return {
        "HOME": str(home),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray folds log lines that differ only in numbers (two ranks' stats lines) into one.
        "RAY_DEDUP_LOGS": "0",
        "VLLM_HOST_IP": LOOPBACK,
        RAY_DEVICE_KEY_ENV: DEVICE_KEY,
        "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT)]),
    }


class RayCluster(SessionProcess):
    """``ray start --head --block`` in its own session under ``workdir``; a context manager.

    Stopped as the server is (``SessionProcess``): ``ray start`` stops what it started on
    SIGTERM; then Ray's logs are kept in ``workdir`` and its temp directory removed.
    """

    label = "ray start"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, workdir / "ray.log")
        self.home = workdir / "home"
        # Not $TMPDIR: nox points it into the virtualenv.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="vbal-ray-", dir="/tmp"))
        self.port = 0

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self) -> None:
        for directory in (self.home, self.temp_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self.port = get_open_port()
        ray = str(Path(sys.executable).with_name("ray"))
        argv = [ray, "start", "--head", "--block", "--node-ip-address", LOOPBACK,
                "--port", str(self.port), "--num-cpus", str(RAY_CPUS), "--num-gpus", str(RAY_GPUS),
                "--temp-dir", str(self.temp_dir), "--include-dashboard", "false",
                "--disable-usage-stats"]  # fmt: skip
        self.launch(argv, {**os.environ, **ray_env(self.home)})

    def wait_ready(self) -> None:
        """Until ``ray start`` says the node is up (its --block line). Raises ServerError."""
        if not self.poll_until_ready(self._up, RAY_START_TIMEOUT_S, poll_s=1):
            raise ServerError(f"Ray not up after {RAY_START_TIMEOUT_S:.0f} s\n{self.log_text()}")

    def _up(self) -> bool:
        return "will now block forever" in self.log_text()

    def after_stop(self) -> None:
        """Ray's logs into ``workdir`` (``ray-logs``); its temp directory removed."""
        logs = self.temp_dir / "session_latest" / "logs"
        if logs.is_dir():
            shutil.copytree(logs, self.workdir / "ray-logs", dirs_exist_ok=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@dataclass
class RayRun(ServerRun):
    steps: list[dict] = field(default_factory=list)
    ray_stop: dict = field(default_factory=dict)
    ray_leftovers: list[int] = field(default_factory=list)
    ray_address: str = ""


class RayRunCache(RunCache):
    """``get(name)`` runs that mode's Ray-backend server once per session."""

    modes = RAY_MODES

    def run(self, mode: Mode) -> RayRun:  # type: ignore[override]
        record = RayRun(mode)
        workdir = self.workdir / mode.name
        (workdir / "steps").mkdir(parents=True)  # step_timing's records, every rank's
        cluster = RayCluster(workdir)
        try:
            with cluster:
                record.ray_address = cluster.address
                env = {
                    **ray_env(cluster.home),
                    "RAY_ADDRESS": cluster.address,
                    STEP_DIR_ENV: str(workdir / "steps"),
                }
                args = ("--data-parallel-backend", "ray", "--data-parallel-address", LOOPBACK)
                spec = self.spec(mode, env=env, extra_args=args)
                self._serve(VllmServer(spec, workdir), record)
                record.steps = step_records(workdir)
        finally:
            record.ray_stop = cluster.stop()
            record.ray_leftovers = cluster.live_pids()
        return record

    @staticmethod
    def _serve(server: VllmServer, record: RayRun) -> None:
        try:
            with server:
                record.started_after_s = server.started_after_s
                serve_the_load(server, record)
                probe_after_the_load(server, record)
                record.serving_log = server.log_text()
        finally:
            record.stop_report = server.stop()
            record.leftovers = server.leftovers()
            record.log = server.log_text()
