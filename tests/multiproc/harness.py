"""Multi-process DP harness: real engine-core processes; the test plays front end + coordinator.

Each rank is a process running vLLM's own ``EngineCoreProc.run_engine_core`` (see ``rank.py``):
upstream's ``DPEngineCoreProc.run_busy_loop`` and ``_has_global_unfinished_reqs``, a real gloo DP
group from ``ParallelConfig.stateless_init_dp_group()``, the real scheduler, the real ZMQ input
and output threads. The model forward is ``standin.StandInExecutor`` (one collective per forward
on a second gloo group, as an MoE layer with expert parallelism).

This module is the other side of vLLM's sockets, written against vLLM's wire format with vLLM's
own encoders (``MsgpackEncoder`` / ``MsgpackDecoder``, ``EngineCoreRequest``):

- the front end's startup handshake (HELLO -> ``EngineHandshakeMetadata`` -> READY), the input
  ROUTER and output PULL sockets, as ``CoreEngineProcManager`` + ``MPClient`` do;
- the DP coordinator's wave protocol, as ``DPCoordinatorProc`` does: XPUB that engines subscribe
  to (READY on subscription, START_DP_WAVE broadcasts), PULL for ``wave_complete`` /
  ``start_wave`` / stats. Playing it here (instead of starting vLLM's coordinator process) makes
  START_DP_WAVE delivery scriptable, which turns timing-dependent wave-boundary races into
  deterministic traces. See docs/testing.md for what exactly is bypassed.

A trace is a list of events (``events.py``). ``Cluster.run_trace`` plays it, waits for the wave
to end, fetches every rank's records through a UTILITY request on the real input queue, and
returns them; ``invariants.check_trace`` asserts the per-run invariants. A run that stops making
progress is a ``Hang``: every rank's stacks are dumped (SIGUSR1 -> faulthandler) and all
processes are killed.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from balance_testbed.stack_dumps import main_thread_frames
from balance_testbed.waiting import wait_for
from tests.multiproc.events import (
    Abort,
    Add,
    DelayWaveStart,
    Event,
    Hang,
    Kill,
    RequestState,
    Sleep,
    Trace,
    TraceResult,
    WaitTokens,
    WaitWaveEnd,
)
from tests.multiproc.rank import rank_main

ROOT = Path(__file__).resolve().parents[2]

# A healthy cluster emits outputs every few ms; after the last request finishes it runs at most
# 31 dummy steps before the wave ends. No message for this long means the cluster is stuck.
DEFAULT_STALL_SECONDS = 8.0
STARTUP_SECONDS = 180.0


# ---------------------------------------------------------------- helpers
_CONTEXT: Any = None


def rank_process_context() -> Any:
    """A forkserver that imported vLLM once (``preload.py``); each rank process forks from it."""
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing

        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["tests.multiproc.preload"])
    return _CONTEXT


def join_ranks(
    procs: Sequence[Any], seconds: float, failed: Callable[[], bool] = lambda: False
) -> None:
    """Wait for every rank process, ``seconds`` at most; once ``failed()`` holds, 5 s more (its
    peers may wait in a collective); then kill what is left and join it."""

    def all_exited() -> bool:
        return not any(proc.is_alive() for proc in procs)

    began = time.monotonic()
    if wait_for(lambda: all_exited() or failed(), seconds, 0.1) is not None:
        wait_for(all_exited, min(5, seconds - (time.monotonic() - began)), 0.1)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)


def _failing_call(log: str) -> str | None:
    """The collective a rank's fatal traceback went through (first one found, innermost-last)."""
    frames = re.findall(
        r"line \d+, in (\w+)", log.split("EngineCore encountered a fatal error")[-1]
    )
    for name in ("balance_gather", "_moe_collective", "sync_dp_state", "has_unfinished_dp"):
        if name in frames:
            return name
    return None


def _pid_exists(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_DEAD
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------- the cluster
class Cluster:
    """N engine-core processes of one mode plus this process as front end and coordinator."""

    def __init__(
        self,
        dp_size: int,
        mode: str = "balance",
        cap: int = 4,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
        extra_env: dict[str, str] | None = None,
        additional_config: dict[str, Any] | None = None,
    ):
        self.dp_size = dp_size
        self.mode = mode
        self.cap = cap
        self.stall_seconds = stall_seconds
        self.extra_env = extra_env or {}
        # Merged into every rank's additional_config (balance tuning keys).
        self.additional_config = additional_config or {}
        self.workdir = Path(tempfile.mkdtemp(prefix="vbh-"))
        self.procs: list[Any] = []  # multiprocessing.Process
        self.requests: dict[str, RequestState] = {}
        self.current_wave = 0
        self.engines_running = False
        self.waves_completed = 0
        self.pending_wave_starts: list[tuple[float, bytes]] = []
        self.wave_start_delay = 0.0
        self.utility_results: dict[int, Any] = {}
        self.dead_messages = 0
        self.dead_message_times: list[float] = []
        self.killed: set[int] = set()
        self.kill_times: dict[int, float] = {}
        self.last_progress = time.monotonic()
        self._call_ids = itertools.count(1)
        self._closed = False
        self.hung = False

    # ---- lifecycle
    def __enter__(self) -> Cluster:
        # One retry: on a shared machine a port picked by get_open_port() can be taken before
        # rank 0 binds it, and then the gloo rendezvous never completes. The first error is kept.
        try:
            self.start()
        except RuntimeError as first:
            self.kill_all()
            self._reset_for_retry()
            try:
                self.start()
            except BaseException:
                self.close()
                raise first from None
        except BaseException:
            self.close()
            raise
        return self

    def _reset_for_retry(self) -> None:
        if hasattr(self, "ctx"):
            self.ctx.destroy(linger=0)
        if os.environ.get("VLLM_BALANCE_HARNESS_KEEP") is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.procs = []
        self.workdir = Path(tempfile.mkdtemp(prefix="vbh-"))

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        import zmq
        from vllm.utils.network_utils import get_open_port, make_zmq_socket
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.encoder = MsgpackEncoder()
        from vllm.v1.engine import EngineCoreOutputs

        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        addr = {name: f"ipc://{self.workdir}/{name}" for name in ("hs", "in", "out", "cin", "cout")}
        self.handshake = make_zmq_socket(self.ctx, addr["hs"], zmq.ROUTER, bind=True)
        self.input = make_zmq_socket(self.ctx, addr["in"], zmq.ROUTER, bind=True)
        self.output = make_zmq_socket(self.ctx, addr["out"], zmq.PULL, bind=True)
        self.coord_publish = make_zmq_socket(self.ctx, addr["cin"], zmq.XPUB, bind=True)
        self.coord_output = make_zmq_socket(self.ctx, addr["cout"], zmq.PULL, bind=True)
        self.addresses = addr
        self.poller = zmq.Poller()
        for sock in (
            self.handshake,
            self.input,
            self.output,
            self.coord_publish,
            self.coord_output,
        ):
            self.poller.register(sock, zmq.POLLIN)
        # Ports for the two DP-wide gloo groups, as the front end's handshake hands them out:
        # the engine core's DP group pops the last one, the stand-in EP group the next.
        self.parallel_config = {
            "data_parallel_master_ip": "127.0.0.1",
            "data_parallel_master_port": get_open_port(),
            "_data_parallel_master_port_list": [get_open_port(), get_open_port()],
            "data_parallel_size": self.dp_size,
        }
        env = {"VLLM_LOGGING_LEVEL": "WARNING", **self.extra_env}
        context = rank_process_context()
        for rank in range(self.dp_size):
            spec = {
                "dp_size": self.dp_size,
                "dp_rank": rank,
                "mode": self.mode,
                "cap": self.cap,
                "handshake_address": addr["hs"],
                "stack_file": str(self.workdir / f"stacks-{rank}.txt"),
                "log_file": str(self.workdir / f"rank-{rank}.log"),
                "tmpdir": str(self.workdir),
                "env": env,
                "additional_config": self.additional_config,
            }
            proc = context.Process(target=rank_main, args=(spec,), name=f"dp-rank-{rank}")
            proc.start()
            self.procs.append(proc)
        self.spawned_at = time.monotonic()
        self._startup()

    def _startup(self) -> None:
        """Front end's handshake + coordinator's subscription/READY, for every rank."""
        import msgspec
        from vllm.v1.engine.utils import EngineHandshakeMetadata, EngineZmqAddresses

        init = msgspec.msgpack.encode(
            EngineHandshakeMetadata(
                addresses=EngineZmqAddresses(
                    inputs=[self.addresses["in"]],
                    outputs=[self.addresses["out"]],
                    coordinator_input=self.addresses["cin"],
                    coordinator_output=self.addresses["cout"],
                ),
                parallel_config=self.parallel_config,
            )
        )
        ready_handshakes: set[int] = set()
        ready_inputs: set[int] = set()
        self.identities = {r: r.to_bytes(2, "little") for r in range(self.dp_size)}
        t0 = self.spawned_at
        deadline = time.monotonic() + STARTUP_SECONDS
        config_hashes = set()
        self.startup_times: dict[str, list[float]] = {}
        while len(ready_handshakes) < self.dp_size or len(ready_inputs) < self.dp_size:
            if time.monotonic() > deadline:
                stacks = self.dump_stacks()
                raise RuntimeError(
                    f"cluster start-up timed out (handshake READY from {sorted(ready_handshakes)}"
                    f", inputs from {sorted(ready_inputs)}):\n"
                    + "\n".join(
                        f"--- rank {r}: {main_thread_frames(stacks[r]) or stacks[r][-2000:]}\n"
                        + self.log_tail(r, 15)
                        for r in range(self.dp_size)
                    )
                )
            for rank, proc in enumerate(self.procs):
                if proc.exitcode is not None:
                    raise RuntimeError(
                        f"rank {rank} exited during start-up (rc={proc.exitcode}):\n"
                        + self.log_tail(rank)
                    )
            events = dict(self.poller.poll(100))
            if self.handshake in events:
                identity, payload = self.handshake.recv_multipart()
                message = msgspec.msgpack.decode(payload)
                rank = int.from_bytes(identity, "little")
                if message["status"] == "HELLO":
                    self.startup_times.setdefault("hello", []).append(time.monotonic() - t0)
                    self.handshake.send_multipart((identity, init))
                elif message["status"] == "READY":
                    ready_handshakes.add(rank)
                    self.startup_times.setdefault("ready", []).append(time.monotonic() - t0)
                    config_hashes.add(message.get("parallel_config_hash"))
            if self.input in events:
                identity, _ready_payload = self.input.recv_multipart()
                ready_inputs.add(int.from_bytes(identity, "little"))
            if self.coord_publish in events:
                self.coord_publish.recv()
            # The coordinator answers subscriptions with READY; repeating it until every engine
            # is up is harmless (engines ignore READY after the first) and robust to XPUB
            # de-duplicating identical subscriptions.
            if len(ready_handshakes) < self.dp_size:
                self.coord_publish.send(b"READY")
            self._drain_nonblocking()
        if len(config_hashes) != 1:
            raise RuntimeError(f"ranks disagree on the parallel config: {config_hashes}")
        self.last_progress = time.monotonic()

    def close(self) -> None:
        """Stop every rank (SIGTERM, then SIGKILL after 10 s) and check none is left."""
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            if proc.is_alive() and not self.hung:
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
        self.kill_all()
        if hasattr(self, "ctx"):
            self.ctx.destroy(linger=0)
        if os.environ.get("VLLM_BALANCE_HARNESS_KEEP") is None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def kill_all(self) -> None:
        """SIGKILL every rank still alive and reap it."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)

    def leftover_processes(self) -> list[int]:
        """Rank pids still present (a zombie counts: it was not reaped)."""
        return [proc.pid for proc in self.procs if proc.pid and _pid_exists(proc.pid)]

    def alive(self) -> list[bool]:
        return [proc.is_alive() for proc in self.procs]

    def log(self, rank: int) -> str:
        """Everything the rank process wrote to stdout/stderr so far (vLLM's and our log lines)."""
        path = self.workdir / f"rank-{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, rank: int, lines: int = 40) -> str:
        return "\n".join(self.log(rank).splitlines()[-lines:])

    def dump_stacks(self) -> dict[int, str]:
        """Every live rank's thread stacks (faulthandler on SIGUSR1)."""
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        stacks = {}
        for rank in range(self.dp_size):
            path = self.workdir / f"stacks-{rank}.txt"
            stacks[rank] = path.read_text(errors="replace") if path.exists() else ""
        return stacks

    # ---- front end
    def _send(self, rank: int, request_type: Any, payload: Any) -> None:
        frames = (self.identities[rank], request_type.value, *self.encoder.encode(payload))
        self.input.send_multipart(frames, copy=False)

    def _broadcast_start_wave(self, wave: int, exclude: int | None) -> None:
        import msgspec
        from vllm.v1.engine import EngineCoreRequestType

        message = (
            EngineCoreRequestType.START_DP_WAVE.value,
            msgspec.msgpack.encode((wave, exclude)),
        )
        due = time.monotonic() + self.wave_start_delay
        self.wave_start_delay = 0.0
        self.pending_wave_starts.append((due, message))

    def add(self, rank: int, request_id: str, prompt_len: int, max_tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType

        seed = zlib.crc32(request_id.encode())
        prompt: Any = [(seed + 13 * i) % 997 + 1 for i in range(prompt_len)]
        if "ndarray" in str(EngineCoreRequest.__annotations__.get("prompt_token_ids")):
            import numpy as np

            prompt = np.asarray(prompt, dtype=np.int32)  # 0.34+: what both frontends send
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            mm_features=None,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=rank,
            current_wave=self.current_wave,
        )
        self.requests[request_id] = RequestState(rank=rank, max_tokens=max_tokens)
        self._send(rank, EngineCoreRequestType.ADD, request)
        # DPAsyncMPClient + DPCoordinatorProc: a request sent while the engines are paused starts
        # the wave on every other engine.
        if not self.engines_running:
            self.engines_running = True
            self._broadcast_start_wave(self.current_wave, rank)

    def abort(self, rank: int, request_ids: Sequence[str]) -> None:
        from vllm.v1.engine import EngineCoreRequestType

        for request_id in request_ids:
            self.requests[request_id].aborted = True
        self._send(rank, EngineCoreRequestType.ABORT, list(request_ids))

    def utility(self, rank: int, method: str, *args: Any, what: str = "utility") -> Any:
        return self.utility_on_ranks([rank], method, *args, what=what)[rank]

    def utility_on_ranks(
        self, ranks: Sequence[int], method: str, *args: Any, what: str = "utility"
    ) -> dict[int, Any]:
        """Call an engine-core utility on ``ranks`` at once (as the API server calls
        ``pause_generation`` or ``sleep`` on every engine), then wait for every result."""
        return self.utility_results_of(
            {rank: self.send_utility(rank, method, *args) for rank in ranks}, f"{what} {method}"
        )

    def utility_results_of(self, call_ids: dict[int, int], what: str) -> dict[int, Any]:
        """Wait for the utility calls ``call_ids`` (rank -> call id); their results by rank."""
        self.wait_until(
            lambda: all(call_id in self.utility_results for call_id in call_ids.values()),
            f"{what} on ranks {list(call_ids)}",
        )
        results = {}
        for rank, call_id in call_ids.items():
            failure, results[rank] = self.utility_results.pop(call_id)
            if failure:
                raise RuntimeError(f"{what} failed on rank {rank}: {failure}")
        return results

    def send_utility(self, rank: int, method: str, *args: Any) -> int:
        """Call an engine-core utility without waiting; ``utility_results`` gets its call id."""
        from vllm.v1.engine import EngineCoreRequestType

        call_id = next(self._call_ids)
        self._send(rank, EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        return call_id

    def drain_records(self) -> dict[int, list]:
        return {
            rank: self.utility(rank, "collective_rpc", "harness_drain_records", what="records")[0]
            for rank in range(self.dp_size)
            if rank not in self.killed
        }

    # ---- message pump
    def _drain_nonblocking(self) -> None:
        now = time.monotonic()
        due = [m for m in self.pending_wave_starts if m[0] <= now]
        for item in due:
            self.pending_wave_starts.remove(item)
            self.coord_publish.send_multipart(item[1])

    def pump(self, timeout_ms: int = 50) -> None:
        self._drain_nonblocking()
        events = dict(self.poller.poll(timeout_ms))
        if self.output in events:
            while self.output.poll(0):
                frames = self.output.recv_multipart(copy=False)
                self.last_progress = time.monotonic()
                if bytes(frames[0].buffer) == b"ENGINE_CORE_DEAD":
                    self.dead_messages += 1
                    self.dead_message_times.append(time.monotonic())
                    continue
                self._on_outputs(self.decoder.decode(frames))
        if self.coord_output in events:
            while self.coord_output.poll(0):
                frames = self.coord_output.recv_multipart(copy=False)
                self.last_progress = time.monotonic()
                self._on_coordinator_message(self.decoder.decode(frames))
        if self.coord_publish in events:
            self.coord_publish.recv()
        if self.input in events:
            self.input.recv_multipart()
        self._drain_nonblocking()

    def _on_outputs(self, outputs: Any) -> None:
        for output in outputs.outputs:
            state = self.requests[output.request_id]
            state.tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                state.finish_reason = output.finish_reason
        if outputs.utility_output is not None:
            utility = outputs.utility_output
            result = utility.result.result if utility.result is not None else None
            self.utility_results[utility.call_id] = (utility.failure_message, result)

    def _on_coordinator_message(self, outputs: Any) -> None:
        # DPCoordinatorProc.process_input_socket's wave bookkeeping, verbatim in substance.
        if (wave := outputs.wave_complete) is not None:
            if self.current_wave <= wave:
                self.current_wave = wave + 1
                self.engines_running = False
                self.waves_completed += 1
        elif (wave := outputs.start_wave) is not None and (
            wave > self.current_wave or (wave == self.current_wave and not self.engines_running)
        ):
            self.current_wave = wave
            self.engines_running = True
            self._broadcast_start_wave(wave, outputs.engine_index)

    def wait_until(self, predicate: Callable[[], bool], what: str) -> None:
        self.last_progress = time.monotonic()
        while not predicate():
            self.pump()
            if time.monotonic() - self.last_progress > self.stall_seconds:
                # SIGTERM cannot end a rank stuck in a collective; close() goes straight to KILL.
                self.hung = True
                raise Hang(what, self.dump_stacks())

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.pump(timeout_ms=max(1, int((end - time.monotonic()) * 1000)))

    # ---- faults
    def observe_survivors(self, window: float) -> dict[int, dict]:
        """After a Kill: for ``window`` seconds, record when each survivor exits; then stacks.

        Returns per surviving rank: ``exited_after`` (seconds from the kill, or None if still
        alive), ``exitcode``, the last log lines, and for a rank still alive the busy-loop
        thread's frames (where it is stuck).
        """
        killed_at = min(self.kill_times.values())
        exited_after: dict[int, float] = {}
        survivors = [r for r in range(self.dp_size) if r not in self.killed]
        end = killed_at + window
        while time.monotonic() < end and len(exited_after) < len(survivors):
            self.pump(timeout_ms=50)
            for rank in survivors:
                if rank not in exited_after and not self.procs[rank].is_alive():
                    exited_after[rank] = time.monotonic() - killed_at
        stacks = self.dump_stacks() if len(exited_after) < len(survivors) else {}
        report = {}
        for rank in survivors:
            report[rank] = {
                "exited_after": exited_after.get(rank),
                "failed_in": _failing_call(self.log_tail(rank, 200)),
                "exitcode": self.procs[rank].exitcode,
                "frames": main_thread_frames(stacks.get(rank, ""))[:12],
                "log": self.log_tail(rank, 60),
            }
        return report

    # ---- traces
    def live_requests_done(self) -> bool:
        return all(
            state.aborted or state.finish_reason is not None or (state.rank in self.killed)
            for state in self.requests.values()
        )

    def wave_ended(self) -> bool:
        return self.live_requests_done() and not self.engines_running

    def play(self, events: Sequence[Event]) -> None:
        for event in events:
            if isinstance(event, Add):
                self.add(event.rank, event.request_id, event.prompt_len, event.max_tokens)
            elif isinstance(event, Abort):
                self.abort(event.rank, event.request_ids)
            elif isinstance(event, WaitTokens):
                state = self.requests[event.request_id]
                self.wait_until(
                    lambda s=state, n=event.n: s.tokens >= n or s.finish_reason is not None,
                    f"{event.n} tokens of {event.request_id}",
                )
            elif isinstance(event, WaitWaveEnd):
                self.wait_until(self.wave_ended, "the wave to end")
            elif isinstance(event, Sleep):
                self.sleep(event.seconds)
            elif isinstance(event, DelayWaveStart):
                self.wave_start_delay = event.seconds
            elif isinstance(event, Kill):
                self.killed.add(event.rank)
                self.procs[event.rank].kill()
                self.kill_times[event.rank] = time.monotonic()
            else:
                raise TypeError(f"unknown event {event!r}")

    def run_trace(self, trace: Trace) -> TraceResult:
        """Play ``trace``, wait for its wave to end, return requests and every rank's records."""
        assert trace.dp_size == self.dp_size
        start = time.monotonic()
        waves_before = self.waves_completed
        self.requests = {}
        self.play(trace.events)
        self.wait_until(self.wave_ended, "the final wave to end")
        records = self.drain_records()
        return TraceResult(
            trace=trace,
            requests=dict(self.requests),
            records=records,
            waves=self.waves_completed - waves_before,
            seconds=time.monotonic() - start,
        )
