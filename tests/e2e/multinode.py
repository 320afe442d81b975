"""The two-host DP server: a head node and a ``--headless`` node, each in its own network namespace.

Production DP MoE runs one DP group across nodes: the head node runs the API server and its
local ranks, each other node runs ``vllm serve --headless`` with the rest, and everything they
exchange crosses the network. Here each node is a network namespace (``tests/e2e/netns.py``)
joined to the other by a veth pair: the head node (API server, DP coordinator, rank 0) in one,
the headless node (rank 1) in the other, with vLLM's multi-node flags (``--data-parallel-size-local
1``, ``--data-parallel-start-rank 1``, ``--data-parallel-address`` the head's veth address,
``--data-parallel-rpc-port``) and ``GLOO_SOCKET_IFNAME`` naming each node's veth, as on two real
hosts whose host names do not resolve to the interface between them (here they resolve to
loopback). The test's own HTTP client runs in the head node's namespace, on its loopback.

``TwoHostRunCache.get(mode)`` starts one two-host server per mode once per pytest session, sends
the same load as the one-host rows (``tests/e2e/runs.py``) and records what each node did; modes
with ``faults`` then pause the headless engine core (SIGSTOP, SIGCONT) and kill the headless node
(SIGKILL) under load, the others are stopped as an operator would (SIGTERM to each node); then
nothing of either node may be left, and both namespaces are removed. The tests
(``tests/e2e/test_multinode.py``) are assertions on that record.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
from vllm_balance_e2e_plugins.step_timing import STEP_DIR_ENV
from vllm_balance_e2e_plugins.variants import VARIANT_ENV

from balance_testbed.load import BackgroundLoad, Outcome, make_prompts
from balance_testbed.server import (
    MODEL_DTYPE,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    DPNode,
    ServerError,
    ServerSpec,
    VllmServer,
    engine_core_main_frames,
    process_name,
)
from balance_testbed.waiting import wait_for
from tests.e2e.netns import Host, TwoHosts, namespace_refusal, tcp_peers
from tests.e2e.runs import MODES, Mode, RunCache, probe_after_the_load, serve_the_load
from tests.multiproc.watchdog_log import watchdog_lines

# Inside the namespaces: nothing else listens there, so fixed ports are free.
RPC_PORT = 13345
HTTP_PORT = 8000
# vLLM's line when an engine core is initialised (profiled, KV cache made, warmed up): the
# headless node's part of the start-up; the head's /health answers once every node's has.
ENGINE_READY = "init engine (profile, create kv cache, warmup model) took"
# The deliberate bug for the metrics assertion's negative control: a test-plugin variant run on
# the headless node only (``VLLM_BALANCE_E2E_HEADLESS_VARIANT=drop_metrics``, docs/testing.md).
HEADLESS_VARIANT_ENV = "VLLM_BALANCE_E2E_HEADLESS_VARIANT"

# Faults. The headless engine core stays stopped this long: longer than the watchdog's
# threshold (balance_gather_warn_s, default 5 s) plus the step the head's rank finishes first.
STOP_S = 15.0
# The head's rank reaches the gather within one step of the stop (a step is well under a second
# here even under load) and reports the wait at warn_s: the ERROR line is due within this.
BLOCKED_SLACK_S = 5.0
# A stop that catches the headless engine core between its gather and its next forward leaves
# the head's rank waiting in the forward's own collective, not in the gather, where the
# watchdog does not look (docs/operations.md, "A blocked gather"): then the stop is repeated.
STOP_ATTEMPTS = 3
# Survivors and the front end notice a dead node within seconds (one host: 3-10 s).
FAULT_WINDOW_S = 60.0
# Long requests, so that the load is still running through every fault attempt.
FAULT_PROMPTS = dict(count=16, seed=1, min_tokens=150, max_tokens=200)


@dataclass(frozen=True)
class TwoHostMode(Mode):
    faults: bool = False  # pause and kill the headless node after the load (else: a clean stop)


TWO_HOST_MODES = {
    "shim": TwoHostMode(**asdict(MODES["shim"])),
    "compat": TwoHostMode(**asdict(MODES["compat"]), faults=True),
    "off": TwoHostMode(**asdict(MODES["off"]), faults=True),
}


@dataclass
class TwoHostRun:
    """What one two-host server did, from start to after both nodes were gone."""

    mode: TwoHostMode
    addresses: dict[str, str] = field(default_factory=dict)  # node -> its veth address
    started_after_s: dict[str, float | None] = field(default_factory=dict)  # node -> seconds
    outcomes: list[Outcome] = field(default_factory=list)
    wave_outcomes: list[Outcome] = field(default_factory=list)
    stall: str | None = None
    health_status: int | None = None
    metrics_status: int | None = None
    metrics_text: str = ""
    # Engine-core process title -> remote addresses of its established TCP connections.
    peers: dict[str, list[str]] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)  # step_timing records of both nodes
    while_up: dict = field(default_factory=dict)  # RunCache.while_up's checks, on the head
    pause: dict | None = None  # the SIGSTOP / SIGCONT fault
    kill: dict | None = None  # the SIGKILL fault
    stop_report: dict = field(default_factory=dict)  # node -> VllmServer.stop_report
    headless_followed_head: bool | None = None  # exited by itself after the head's SIGTERM
    leftovers: list[str] = field(default_factory=list)
    namespaces_left: list[str] = field(default_factory=list)
    serving_log: dict[str, str] = field(default_factory=dict)  # node -> start-up and load
    log: dict[str, str] = field(default_factory=dict)  # node -> everything

    def texts(self) -> dict[str, str]:
        return {o.prompt.key: o.text for o in self.outcomes}

    def serving_logs(self) -> str:
        return "\n".join(self.serving_log.values())

    def summary(self) -> dict:
        """The numbers a report needs (written beside the logs as two-hosts.json)."""
        return {
            "mode": self.mode.name,
            "addresses": self.addresses,
            "started_after_s": self.started_after_s,
            "peers": self.peers,
            "pause": self.pause,
            "kill": self.kill,
            "stop_report": self.stop_report,
            "headless_followed_head": self.headless_followed_head,
            "leftovers": self.leftovers,
            "namespaces_left": self.namespaces_left,
        }


# What each host's environment adds (docs/operations.md, "Multi-node DP"): gloo binds to the
# address the host name resolves to unless told the interface; the address vLLM advertises.
NODE_ENV = ("GLOO_SOCKET_IFNAME", "VLLM_HOST_IP")


def node_spec(base: ServerSpec, hosts: TwoHosts, host: Host, rank: int, workdir: Path):
    """``base`` as ``host``'s part of the two-host group (rank ``rank``)."""
    node = DPNode(address=hosts.head.address, rpc_port=RPC_PORT, start_rank=rank)
    env = {
        **base.env,
        **dict(zip(NODE_ENV, (host.interface, host.address))),
        STEP_DIR_ENV: str(workdir),
    }
    variant = os.environ.get(HEADLESS_VARIANT_ENV)
    if variant and node.headless:
        env[VARIANT_ENV] = variant
    return ServerSpec(
        base.model,
        dp_size=base.dp_size,
        dtype=base.dtype,
        additional_config=base.additional_config,
        env=env,
        node=node,
    )


class TwoHostRunCache(RunCache):
    """``get(name)`` runs that mode's two-host server once per session and returns its record."""

    modes = TWO_HOST_MODES

    def get(self, name: str) -> TwoHostRun:
        refusal = namespace_refusal()
        if refusal:
            pytest.skip(f"two hosts cannot be made here: {refusal}")
        return super().get(name)

    def run(self, mode: TwoHostMode) -> TwoHostRun:  # type: ignore[override]
        record = TwoHostRun(mode)
        workdir = self.workdir / mode.name
        hosts = TwoHosts()
        try:
            with hosts:
                record.addresses = {h.name: h.address for h in hosts.hosts}
                # The whole run on a thread in the head node's namespace: the client, the
                # probes and the load's threads talk to the head's loopback from there.
                hosts.call_in(hosts.head, self._serve, hosts, record, workdir)
        finally:
            record.namespaces_left = hosts.leftovers()
            (workdir / "two-hosts.json").write_text(json.dumps(record.summary(), indent=1))
        return record

    def _serve(self, hosts: TwoHosts, record: TwoHostRun, workdir: Path) -> None:
        base = ServerSpec(
            self.model, dtype=MODEL_DTYPE, additional_config=record.mode.additional_config
        )
        servers = {}
        for rank, host in enumerate(hosts.hosts):
            directory = workdir / host.name
            directory.mkdir(parents=True)
            spec = node_spec(base, hosts, host, rank, directory)
            servers[host.name] = VllmServer(
                spec, directory, prefix=TwoHosts.exec_prefix(host), port=HTTP_PORT
            )
        head, node1 = servers["head"], servers["node1"]
        try:
            head.start()
            node1.start()
            record.started_after_s = wait_until_up(head, node1)
            serve_the_load(head, record)
            record.peers = {
                f"{process_name(pid)} on {name}": sorted(tcp_peers(pid))
                for name, server in servers.items()
                for pid in server.pids_named("VLLM::EngineCore")
            }
            probe_after_the_load(head, record)
            record.serving_log = {name: s.log_text() for name, s in servers.items()}
            record.steps = step_records(workdir)
            for name, check in self.while_up.get(record.mode.name, {}).items():
                record.while_up[name] = check(head)  # on this thread: the head's namespace
            if record.mode.faults:
                record.pause = pause_headless_engine_core(head, node1, record.mode)
                record.kill = kill_headless_node(head, node1)
        finally:
            record.stop_report, record.headless_followed_head = stop_both(head, node1)
            record.leftovers = head.leftovers() + node1.leftovers()
            record.log = {name: s.log_text() for name, s in servers.items()}


def wait_until_up(head: VllmServer, node1: VllmServer) -> dict[str, float | None]:
    """Seconds from start until each node is up: the head's /health 200 (which needs every
    node's engines), the headless node's engine core initialised. Raises ServerError."""
    began = time.monotonic()
    node1_up = None

    def head_healthy() -> bool:
        nonlocal node1_up
        for name, server in (("head", head), ("node1", node1)):
            server.note_processes()
            if server.process.poll() is not None:
                raise ServerError(
                    f"{name} node exited with {server.process.returncode} during start-up\n"
                    f"{server.log_tail()}"
                )
        if node1_up is None and ENGINE_READY in node1.log_text():
            node1_up = round(time.monotonic() - began, 1)
        return head.http_status("/health", timeout_s=5) == 200

    if wait_for(head_healthy, STARTUP_TIMEOUT_S, 2) is None:
        raise ServerError(
            f"two-host server not healthy after {STARTUP_TIMEOUT_S:.0f} s\n"
            f"head:\n{head.log_tail()}\nnode1:\n{node1.log_tail()}"
        )
    head.started_after_s = time.monotonic() - began
    return {"head": round(head.started_after_s, 1), "node1": node1_up}


def step_records(workdir: Path) -> list[dict]:
    """Every engine core's step_timing lines, both nodes."""
    records = []
    for path in sorted(workdir.glob("*/steps-*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


def frozen_decisions(steps: list[dict]) -> dict[int, dict[int, bool]]:
    """gather number -> {rank: frozen}, from step records (the same number is the same
    collective on every rank: ranks that read the same gathered vector must decide alike)."""
    decisions: dict[int, dict[int, bool]] = {}
    for step in steps:
        if "gather" in step:
            decisions.setdefault(step["gather"], {})[step["rank"]] = step["frozen"]
    return decisions


def _head_watchdog(head: VllmServer, since: int, kind: str) -> list:
    return [
        line
        for line in watchdog_lines(head.log_text()[since:])
        if line.rank == 0 and line.kind == kind
    ]


def pause_headless_engine_core(head: VllmServer, node1: VllmServer, mode: Mode) -> dict:
    """SIGSTOP the headless node's engine core under load for ``STOP_S``, then SIGCONT.

    With balance on, the head's rank must log the gather watchdog's ERROR within its threshold
    and the recovery line after SIGCONT; with balance off (the control) it logs neither. Every
    request must then complete.
    """
    from vllm_balance.config import DEFAULT_GATHER_WARN_S

    load = BackgroundLoad(head.base_url, make_prompts(**FAULT_PROMPTS), stall_s=STOP_S * 4)
    load.start()
    if not load.wait_for_tokens(64, timeout_s=300):
        raise ServerError(f"no tokens before the pause\n{head.log_tail()}")
    [victim] = node1.pids_named("VLLM::EngineCore_DP1")
    since = len(head.log_text())
    attempts = []
    for _ in range(STOP_ATTEMPTS):
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        blocked_after_s = wait_for(
            lambda: _head_watchdog(head, since, "blocked"),
            DEFAULT_GATHER_WARN_S + BLOCKED_SLACK_S,
        )
        attempt = {"blocked_after_s": blocked_after_s}
        if blocked_after_s is None and mode.path:  # where the head's rank waits instead
            attempt["head_frames"] = engine_core_main_frames(head.dump_stacks())
        time.sleep(max(0.0, STOP_S - (time.monotonic() - stopped)))
        os.kill(victim, signal.SIGCONT)
        attempt["stopped_s"] = round(time.monotonic() - stopped, 1)
        if blocked_after_s is not None:
            attempt["unblocked_after_s"] = wait_for(
                lambda: _head_watchdog(head, since, "unblocked"), 30.0
            )
        attempts.append(attempt)
        if blocked_after_s is not None or not mode.path or not load.is_alive():
            break
    load.join(timeout=STOP_S * 4 + 600)
    log = head.log_text()[since:]
    return {
        "attempts": attempts,
        "outcomes": [asdict(o) for o in load.outcomes or []],
        "sent": FAULT_PROMPTS["count"],
        "error": repr(load.error) if load.error else None,
        "head_watchdog": [asdict(line) for line in watchdog_lines(log)],
        "head_error_lines": [ln for ln in log.splitlines() if " ERROR " in ln],
    }


def kill_headless_node(head: VllmServer, node1: VllmServer) -> dict:
    """SIGKILL every process of the headless node once tokens flow; what clients and head did."""
    load = BackgroundLoad(head.base_url, make_prompts(**FAULT_PROMPTS), stall_s=FAULT_WINDOW_S * 2)
    load.start()
    if not load.wait_for_tokens(64, timeout_s=300):
        raise ServerError(f"no tokens before the kill\n{head.log_tail()}")
    victims = node1.live_pids()
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed = time.monotonic()
    load.join(timeout=FAULT_WINDOW_S)
    clients_done_s = None if load.is_alive() else round(load.progress.last_finished - killed, 1)
    head_exit_s = wait_for(lambda: head.process.poll() is not None, FAULT_WINDOW_S, 0.25)
    outcomes = load.outcomes or []
    return {
        "killed": len(victims),
        "sent": FAULT_PROMPTS["count"],
        "clients_done_s": clients_done_s,
        "errors": sum(o.error is not None for o in outcomes),
        "completed": sum(o.error is None for o in outcomes),
        # Neither an error nor every token: a request silently lost.
        "silently_short": [
            o.prompt.key
            for o in outcomes
            if o.error is None and o.completion_tokens != o.prompt.max_tokens
        ],
        "load_error": repr(load.error) if load.error else None,
        "head_exit_s": head_exit_s,
        "head_returncode": head.process.poll(),
        "outcomes": [asdict(o) for o in outcomes],
    }


def stop_both(head: VllmServer, node1: VllmServer) -> tuple[dict, bool | None]:
    """SIGTERM the head; see whether the headless node follows by itself; then stop it too."""
    node1_running = node1.process is not None and node1.process.poll() is None
    report = {"head": head.stop()}
    followed = None  # the headless node was gone (killed) before the head stopped
    if node1_running:
        followed = wait_for(lambda: node1.process.poll() is not None, STOP_TIMEOUT_S) is not None
    report["node1"] = node1.stop()
    return report, followed
