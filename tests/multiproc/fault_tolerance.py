"""One DP rank under vLLM's fault tolerance: its busy loop runs in ``fault_tolerant_wrapper``.

A process per rank (``test_fault_tolerance.py`` starts them from the harness's forkserver).

Real, vLLM's own: the DP group (a gloo group from ``_init_data_parallel``), the balance scheduler
built as activation selects it, ``BalanceDPEngineCoreProc._has_global_unfinished_reqs`` (vLLM's DP
sync, then the balance gather), ``fault_tolerant_wrapper`` around the loop, ``EngineCoreSentinel``
(``on_fault``: abort every request, push the status, wait for ``retry``; ``handle_command`` /
``retry``: the round check-in, the DP group's re-init, the success vote on 0.34) and the abort
outputs it queues.

Driven by the test, as nothing of them exists on CPU: vLLM refuses ``--enable-fault-tolerance`` on
its CPU build when the config is built, so the flag is set on the built config. The engine core's
``__init__`` (front end, executor, model: the attributes the loop and the sentinel read are set as
in ``resize.py``), the busy loop's body (``driven_busy_loop``: schedule, a fabricated forward, the
scheduler's update, then the DP step's ``_has_global_unfinished_reqs``; a fault is a
``RuntimeError`` raised after the forward and before the gather, or the process killing itself
there), the workers' FT commands (``collective_rpc``), and the orchestrator that sends ``retry``:
each rank's "input thread" sends it to its own sentinel once every rank has reported UNHEALTHY
(``unhealthy/<round>/<rank>`` keys in the test's store), with one request id per round, as the API
server's fault-tolerance endpoint does to every engine.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any

CAP = 2
MAX_TOKENS = 1000  # requests keep running for the whole test


class FaultToleranceWorkers:
    """The executor's ``collective_rpc`` for the sentinel's commands to the workers (on the
    device in vLLM): every worker answers, no all2all peer suspected."""

    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
        self.calls: list[str] = []

    def collective_rpc(self, method: str, timeout: Any = None, args: tuple = (), **kwargs: Any):
        instruction = getattr(args[0], "instruction", None) if args else None
        self.calls.append(f"{method}:{instruction}")
        if instruction == "query_mask":
            return [{"mask": [0] * self.dp_size}]
        return [None]


class RankRecorder:
    """What the rank saw, written for the test: steps, faults, statuses, retries, aborts."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps: list[dict] = []
        self.faults: list[dict] = []
        self.statuses: list[list] = []
        self.retries: list[dict] = []
        self.aborted: list[str] = []
        self.added: list[str] = []
        self.fault_injected_at: list[list] = []  # [round, monotonic time]


def _store(spec: dict) -> Any:
    """A client of the test's store; one per thread (a client blocked in ``wait`` holds its
    socket)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", spec["store_port"], is_master=False)


def _output_thread(engine: Any, recorder: RankRecorder, spec: dict, stop: threading.Event):
    """The output thread's stand-in: reads what the sentinel and the engine queue for clients."""
    from vllm.v1.engine import FT_STATUS_CALL_ID

    store = _store(spec)

    unhealthy = 0
    while not stop.is_set():
        try:
            _, outputs = engine.output_queue.get(timeout=0.05)
        except queue.Empty:
            continue
        recorder.aborted.extend(
            output.request_id for output in outputs.outputs if output.finish_reason is not None
        )
        utility = outputs.utility_output
        if utility is None:
            continue
        result = utility.result.result if utility.result is not None else None
        if utility.call_id == FT_STATUS_CALL_ID:
            recorder.statuses.append([time.monotonic(), result["status"]])
            if result["status"] == "unhealthy":
                store.set(f"unhealthy/{unhealthy}/{recorder.rank}", b"1")
                unhealthy += 1
        else:
            recorder.retries.append({"at": time.monotonic(), **(result or {})})


def _input_thread(engine: Any, spec: dict) -> None:
    """The orchestrator's ``retry`` for each fault round, once every rank is UNHEALTHY."""
    from datetime import timedelta

    store = _store(spec)

    for round_index in range(spec["retries"]):
        keys = [f"unhealthy/{round_index}/{rank}" for rank in range(spec["dp_size"])]
        try:
            store.wait(keys, timedelta(seconds=spec["recovery_s"]))
        except Exception:  # a peer never reported: no retry, the wrapper gives up
            return
        request = {"instruction": "retry", "params": {}, "request_id": f"retry-{round_index}"}
        engine.ft_sentinel.handle_command(0, 100 + round_index, request)


def _step(engine: Any, recorder: RankRecorder, adds: int, label: str, fault: str | None):
    from tests.multiproc.resize import scheduled_step

    scheduler = engine.scheduler
    record, added = scheduled_step(scheduler, adds, label, MAX_TOKENS)
    recorder.added.extend(added)
    record["group"] = id(engine.dp_group)
    recorder.steps.append(record)
    if fault is not None:  # after the forward, before the gather: the peers wait in the gather
        recorder.fault_injected_at.append([engine.harness_round, time.monotonic()])
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault on DP{recorder.rank} at {label}")
    engine._has_global_unfinished_reqs(True)  # vLLM's DP sync, then the balance gather
    from balance_testbed.factories import gate_read

    record["gathered"] = gate_read(scheduler)


def driven_busy_loop(engine: Any) -> None:
    """The loop ``fault_tolerant_wrapper`` runs: each round's steps; a round that ended in a
    fault resumes, after ``retry``, with the next round. Ends with ``SystemExit`` as vLLM's."""
    plan, recorder = engine.harness_plan, engine.harness_recorder
    while plan["next_round"] < len(plan["rounds"]):
        round_index = plan["next_round"]
        plan["next_round"] += 1
        for step_index, step in enumerate(plan["rounds"][round_index]):
            label = f"r{recorder.rank}-round{round_index}-{step_index}"
            engine.harness_round = round_index
            _step(engine, recorder, step["adds"], label, step.get("fault"))
    raise SystemExit(0)


def _observe_faults(sentinel: Any, recorder: RankRecorder, engine: Any) -> None:
    """Record each fault the wrapper hands to ``on_fault`` (observation only)."""
    upstream_on_fault = sentinel.on_fault

    def on_fault(exc: Exception) -> None:
        frames = [frame.name for frame in traceback.extract_tb(exc.__traceback__)]
        recorder.faults.append(
            {
                "at": time.monotonic(),
                "round": engine.harness_round,
                "type": type(exc).__name__,
                "message": str(exc)[:300],
                "in_gather": "balance_gather" in frames,
                "running": len(engine.scheduler.running),
            }
        )
        upstream_on_fault(exc)

    sentinel.on_fault = on_fault


def run(spec: dict, recorder: RankRecorder) -> dict:
    from vllm.v1.fault_tolerance.engine_core_sentinel import (
        EngineCoreSentinel,
        fault_tolerant_wrapper,
    )

    from balance_testbed import factories
    from tests.multiproc.resize import _engine
    from vllm_balance.activation import activate_for
    from vllm_balance.config import COLLECTIVE_KEY, GATHER_WARN_KEY

    rank = spec["rank"]
    config = factories.make_vllm_config(
        moe=True,
        max_num_seqs=CAP,
        data_parallel_size=spec["dp_size"],
        additional_config={
            "enable_balance_scheduling": True,
            COLLECTIVE_KEY: spec["collective"],
            GATHER_WARN_KEY: spec["warn_s"],
        },
    )
    parallel_config = config.parallel_config
    parallel_config.data_parallel_rank = parallel_config.data_parallel_rank_local = rank
    parallel_config.data_parallel_master_ip = "127.0.0.1"
    parallel_config._data_parallel_master_port_list = [spec["port"]]
    parallel_config.enable_fault_tolerance = True  # refused on CPU when the config is built
    parallel_config.fault_tolerance_config.engine_recovery_timeout_sec = spec["recovery_s"]
    assert activate_for(config, dp_rank=rank)  # no refusal; logs the gather timeout
    scheduler = factories.make_scheduler(config.scheduler_config.get_scheduler_cls(), config)
    workers = FaultToleranceWorkers(spec["dp_size"])
    engine = _engine(config, scheduler, workers)
    engine.enable_fault_tolerance = True
    engine.batch_queue = None
    engine.ft_sentinel = EngineCoreSentinel(engine, parallel_config)
    _observe_faults(engine.ft_sentinel, recorder, engine)
    engine.harness_plan = {"rounds": spec["rounds"], "next_round": 0}
    engine.harness_recorder, engine.harness_round = recorder, 0
    stop = threading.Event()
    threads = [
        threading.Thread(target=_output_thread, args=(engine, recorder, spec, stop), daemon=True),
        threading.Thread(target=_input_thread, args=(engine, spec), daemon=True),
    ]
    for thread in threads:
        thread.start()
    ended = "returned"
    try:
        fault_tolerant_wrapper(driven_busy_loop)(engine)
    except SystemExit:
        ended = "SystemExit"
    except Exception as exc:  # no recovery within engine_recovery_timeout_sec: re-raised
        ended = f"{type(exc).__name__}: {exc}"[:300]
    time.sleep(0.2)  # the output thread reads what is still queued
    stop.set()
    return {
        "ended": ended,
        "steps": recorder.steps,
        "faults": recorder.faults,
        "fault_injected_at": recorder.fault_injected_at,
        "statuses": recorder.statuses,
        "retries": recorder.retries,
        "added": recorder.added,
        "aborted": recorder.aborted,
        "in_scheduler": sorted(request.request_id for request in scheduler.running)
        + sorted(request.request_id for request in scheduler.waiting),
        "workers": workers.calls,
        "status": engine.ft_sentinel.status_type.name,
    }


def rank_main(spec: dict) -> None:
    """Process target (forkserver child): its log to a file, ``run``, its result for the test."""
    from tests.multiproc.rank import apply_inherited_mutant

    apply_inherited_mutant()
    log_fd = os.open(spec["log_file"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    vllm_logger = logging.getLogger("vllm")  # as an engine process configures it
    if not vllm_logger.hasHandlers():
        vllm_logger.addHandler(logging.StreamHandler())
    vllm_logger.setLevel(logging.INFO)
    recorder = RankRecorder(spec["rank"])
    try:
        result = {"ok": run(spec, recorder)}
    except BaseException as exc:  # reported to the test, which names the rank
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    with open(spec["result_file"], "w", encoding="utf-8") as out:
        json.dump(result, out)
