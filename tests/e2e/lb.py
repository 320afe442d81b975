"""DP load-balancing shapes with more than one API server: external, multi-port external, hybrid.

vLLM runs one DP group behind several API servers when a load balancer outside vLLM spreads the
requests: external LB (``--data-parallel-rank R``: one API server per rank, each its own
command), multi-port external LB (one command, ``--data-parallel-multi-port-external-lb``: a
supervisor starts an API server per local rank on consecutive ports) and hybrid LB
(``--data-parallel-hybrid-lb``: one API server per node for its local ranks; vLLM turns it into
external LB when a node has one rank, so it needs DP >= 4 for two nodes). Here every API server
listens on loopback; the DP group's address is 127.0.0.1.

``LBRunCache.get(shape)`` starts that shape's processes once per pytest session, sends the
one-host rows' 48 requests spread round-robin over every API server (the external balancer's
part), scrapes each API server's ``/metrics`` and stops every process as an operator would. The
tests (``tests/e2e/test_lb.py``) are assertions on that record.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from vllm.utils.network_utils import get_open_port
from vllm_balance_e2e_plugins.step_timing import STEP_DIR_ENV

from balance_testbed.load import Outcome, Stall, make_prompts, send_concurrently
from balance_testbed.server import (
    BALANCE_ON,
    EXTERNAL_LB,
    HYBRID_LB,
    MULTI_PORT_LB,
    STARTUP_TIMEOUT_S,
    DPNode,
    ServerError,
    VllmServer,
)
from balance_testbed.waiting import wait_for
from tests.e2e.multinode import step_records
from tests.e2e.runs import LOAD_REQUESTS, STALL_S, Mode, RunCache

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LBShape(Mode):
    lb: str = EXTERNAL_LB
    dp_size: int = 2
    size_local: int = 1  # ranks per command (process group)

    @property
    def nodes(self) -> int:
        return self.dp_size // self.size_local


LB_SHAPES = {
    "external": LBShape("external", True, BALANCE_ON, "shim", EXTERNAL_LB),
    "multi-port": LBShape("multi-port", True, BALANCE_ON, "shim", MULTI_PORT_LB, size_local=2),
    "hybrid": LBShape("hybrid", True, BALANCE_ON, "shim", HYBRID_LB, dp_size=4, size_local=2),
}


@dataclass
class LBRun:
    """What one shape's servers did, from start to after their stop."""

    mode: LBShape
    started_after_s: float | None = None
    ports: dict[int, list[int]] = field(default_factory=dict)  # API port -> ranks it serves
    outcomes: list[Outcome] = field(default_factory=list)
    stall: str | None = None
    health: dict[int, int | None] = field(default_factory=dict)  # API port -> /health status
    metrics_text: dict[int, str] = field(default_factory=dict)  # API port -> its /metrics
    steps: list[dict] = field(default_factory=list)  # step_timing records of every rank
    stop_report: dict[int, dict] = field(default_factory=dict)  # command index -> stop report
    leftovers: list[str] = field(default_factory=list)
    serving_log: str = ""  # every command's start-up and load
    log: str = ""

    def texts(self) -> dict[str, str]:
        return {o.prompt.key: o.text for o in self.outcomes}


class LBRunCache(RunCache):
    """``get(name)`` runs that shape's servers once per session and returns its record."""

    modes = LB_SHAPES

    def run(self, mode: LBShape) -> LBRun:  # type: ignore[override]
        record = LBRun(mode)
        workdir = self.workdir / mode.name
        rpc_port = get_open_port()
        servers, ports = [], {}
        for index in range(mode.nodes):
            node = DPNode(LOOPBACK, rpc_port, mode.size_local, index * mode.size_local, mode.lb)
            directory = workdir / f"node{index}"
            directory.mkdir(parents=True)
            port = get_open_port()
            extra: tuple[str, ...] = ()
            if mode.lb == MULTI_PORT_LB:  # the supervisor's own health port, off the API ports
                extra = ("--data-parallel-supervisor-port", str(get_open_port()))
            spec = self.spec(
                mode,
                dp_size=mode.dp_size,
                node=node,
                extra_args=extra,
                env={STEP_DIR_ENV: str(directory)},
            )
            servers.append(VllmServer(spec, directory, port=port))
            for offset in range(node.api_servers):
                served = (
                    [node.start_rank + offset]
                    if mode.lb != HYBRID_LB
                    else list(range(node.start_rank, node.start_rank + node.size_local))
                )
                ports[port + offset] = served
        record.ports = ports
        try:
            for server in servers:
                server.start()
            record.started_after_s = wait_until_every_port_is_healthy(servers, ports)
            record.outcomes, record.stall = spread_the_load(list(ports))
            time.sleep(2)  # a step's stats reach its API server just after its tokens
            for port in ports:
                record.health[port] = servers[0].http_status_at(port, "/health")
                record.metrics_text[port] = servers[0].http_text_at(port, "/metrics")
            record.serving_log = "\n".join(s.log_text() for s in servers)
            record.steps = step_records(workdir)
        finally:
            for index, server in enumerate(servers):
                record.stop_report[index] = server.stop()
            record.leftovers = [left for server in servers for left in server.leftovers()]
            record.log = "\n".join(s.log_text() for s in servers)
        return record


def wait_until_every_port_is_healthy(servers: list[VllmServer], ports) -> float:
    """Seconds from start until every API port answers /health 200. Raises ServerError."""

    def every_port_healthy() -> bool:
        for server in servers:
            server.note_processes()
            if server.process.poll() is not None:
                raise ServerError(
                    f"{server.workdir.name} exited with {server.process.returncode} during "
                    f"start-up\n{server.log_tail()}"
                )
        return all(servers[0].http_status_at(port, "/health", 5) == 200 for port in ports)

    seconds = wait_for(every_port_healthy, STARTUP_TIMEOUT_S, 2)
    if seconds is None:
        tails = "\n".join(f"{s.workdir.name}:\n{s.log_tail()}" for s in servers)
        raise ServerError(f"not every API server healthy after {STARTUP_TIMEOUT_S:.0f} s\n{tails}")
    return seconds


def spread_the_load(ports: list[int]) -> tuple[list[Outcome], str | None]:
    """The 48 requests, round-robin over the API servers, all at once (the external balancer)."""
    prompts = make_prompts(LOAD_REQUESTS)
    shares = {port: prompts[i :: len(ports)] for i, port in enumerate(ports)}
    outcomes: dict[int, list[Outcome]] = {}
    stalls: list[str] = []

    def send(port: int) -> None:
        try:
            outcomes[port] = send_concurrently(f"http://{LOOPBACK}:{port}", shares[port], STALL_S)
        except Stall as stall:
            stalls.append(f"port {port}: {stall}")

    threads = [threading.Thread(target=send, args=(port,)) for port in ports]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    merged = [o for port in ports for o in outcomes.get(port, [])]
    return merged, "; ".join(stalls) or None
