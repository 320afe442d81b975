"""One DP rank of an elastic-EP resize, driven by vLLM's own ``ElasticEPScalingState``.

A process per rank (``test_resize.py`` starts them from the harness's forkserver). Each builds a
real balance scheduler and a ``BalanceDPEngineCoreProc`` whose DP group comes from vLLM's own
``_init_data_parallel`` (a real gloo group), steps it on the old group
(``_has_global_unfinished_reqs`` runs vLLM's DP sync, then the balance gather), resizes through
``ElasticEPScalingState``'s own states (the new group from ``_ensure_new_dp_group``, the KV-size
sync, ``_commit_scale_down``, ``_commit_new_dp_group``, ``_update_parallel_config``; a new rank's
``run_pre_kv_init_states`` and PREPARE), then steps on the new group. What each step decided is
written to a JSON file.

Stood in, as nothing of them exists on CPU: the engine core's ``__init__`` (front end, executor
and model; the attributes vLLM's DP step and the commit read are set here instead) and the
workers' ``elastic_ep_execute`` RPCs (EPLB reshuffle and weight transfer on the device).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from copy import deepcopy
from typing import Any

CAP = 2
MAX_TOKENS = 1000  # requests keep running for the whole test


class WorkerRpcStandIn:
    """The executor's ``collective_rpc``: the workers' elastic-EP steps run on the device."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def collective_rpc(self, method: str, timeout: Any = None, args: tuple = (), **kwargs: Any):
        self.calls.append((method, *args[:1]))
        return [None]


def _engine(vllm_config: Any, scheduler: Any, executor: WorkerRpcStandIn) -> Any:
    from vllm_balance.shim.engine_core import BalanceDPEngineCoreProc

    engine = BalanceDPEngineCoreProc.__new__(BalanceDPEngineCoreProc)
    parallel_config = vllm_config.parallel_config
    engine.vllm_config = vllm_config
    engine.scheduler = scheduler
    engine.model_executor = executor
    engine.engine_index = parallel_config.data_parallel_rank
    engine.dp_sync_interval = parallel_config.dp_sync_interval
    engine.step_counter, engine.current_wave = 0, 0
    engine.engines_running, engine.pending_pause, engine.ignore_start_dp_wave = True, False, False
    engine.enable_fault_tolerance = False  # read by the DP sync from 0.34 on
    engine.available_gpu_memory_for_kv_cache = 1 << 30
    # _eep_send_engine_core_notification puts its message here while the output thread lives.
    engine.output_queue, engine.output_thread = queue.Queue(), threading.current_thread()
    engine._init_data_parallel(vllm_config)  # vLLM's: the gloo DP group, handed over at once
    return engine


def scheduled_step(
    scheduler: Any, adds: int, label: str, max_tokens: int = MAX_TOKENS
) -> tuple[dict, list[str]]:
    """``adds`` new requests, then one scheduler step (forward and update); what the step's gate
    read and did, and the ids of the requests added. The faults harness steps the same way."""
    from balance_testbed import factories

    requests = factories.make_requests(adds, prompt_len=8, max_tokens=max_tokens, prefix=label)
    factories.add_requests(scheduler, requests)
    output, _ = factories.step(scheduler)
    record = {
        "label": label,
        "read": factories.gate_read(scheduler),  # what this step's gate read
        "frozen": scheduler.balance_gate.frozen,
        "admitted": len(output.scheduled_new_reqs),
        "running": len(scheduler.running),
    }
    return record, [request.request_id for request in requests]


def _step(engine: Any, adds: int, label: str) -> dict:
    scheduler = engine.scheduler
    record, _ = scheduled_step(scheduler, adds, label)
    engine._has_global_unfinished_reqs(True)  # vLLM's DP sync, then the balance gather
    from balance_testbed.factories import gate_read

    stats, watchdog = scheduler.balance_gate.stats, scheduler.balance_gate.watchdog
    record.update(
        gathered=gate_read(scheduler),
        gathered_mean=stats.gathered_mean,
        watchdog=[watchdog.dp_rank, watchdog.dp_size],
        group=[engine.dp_group.rank(), engine.dp_group.size()],
    )
    return record


def _resize(engine: Any, spec: dict) -> None:
    """The rank's part of the resize, through vLLM's own states, in the order its busy loop
    runs them (``run_busy_loop`` calls ``progress()`` once per iteration)."""
    from vllm.distributed.elastic_ep.elastic_state import (
        ElasticEPScalingState,
        ScaleDownRemainingEngineState,
        ScaleUpExistingEngineState,
    )
    from vllm.v1.engine import ReconfigureDistributedRequest, ReconfigureRankType

    role, new_size = spec["role"], spec["new_size"]
    scale = "scale_up" if new_size > spec["old_size"] else "scale_down"
    if role == "new":  # started with the new size: its group is already the new one
        state = ElasticEPScalingState(
            engine.model_executor, engine, engine.vllm_config, engine.vllm_config.parallel_config,
            worker_type="new", scale_type="scale_up",
        )  # fmt: skip
        state.run_pre_kv_init_states()
        state.progress()
        assert state.is_complete(), state.state
        return
    request = ReconfigureDistributedRequest(
        new_data_parallel_size=new_size,
        new_data_parallel_rank=(
            ReconfigureRankType.SHUTDOWN_CURRENT_RANK
            if role == "removing"
            else ReconfigureRankType.KEEP_CURRENT_RANK
        ),
        new_data_parallel_rank_local=ReconfigureRankType.KEEP_CURRENT_RANK,
        new_data_parallel_master_ip="127.0.0.1",
        new_data_parallel_master_port=spec["new_port"],
        new_data_parallel_master_port_list=[],
        coord_store_port=spec["coord_port"],
    )
    # As DPEngineCoreProc.reinitialize_distributed builds it.
    new_parallel_config = deepcopy(engine.vllm_config.parallel_config)
    new_parallel_config.data_parallel_size = new_size
    new_parallel_config.data_parallel_master_port = spec["new_port"]
    new_parallel_config._data_parallel_master_port_list = []
    new_parallel_config._coord_store_port = spec["coord_port"]
    state = ElasticEPScalingState(
        engine.model_executor, engine, engine.vllm_config, new_parallel_config,
        worker_type="removing" if role == "removing" else "existing",
        scale_type=scale, reconfig_request=request,
    )  # fmt: skip
    if role == "removing":
        state.progress()  # _commit_scale_down(removing=True); vLLM then exits the busy loop
        assert state.is_complete(), state.state
        return
    while not state._ensure_new_dp_group():  # PREPARE's group creation, polled
        time.sleep(0.01)
    # PREPARE's remaining part is the workers' (prepare_reconfiguration on the device).
    state.state = (
        ScaleUpExistingEngineState.SYNC_KV_CACHE_MEMORY_SIZE
        if scale == "scale_up"
        else ScaleDownRemainingEngineState.COMMIT_SCALE_DOWN
    )
    while not state.is_ready_for_switch():
        state.progress()
        time.sleep(0.01)
    state.commit_requested = True  # what commit_prepared_elastic_ep sets
    state.progress()
    assert state.is_complete(), state.state


def run(spec: dict) -> dict:
    import vllm_balance
    from balance_testbed import factories

    config = factories.make_vllm_config(
        moe=True,
        max_num_seqs=CAP,
        data_parallel_size=spec["start_size"],
        additional_config={
            "enable_balance_scheduling": True,
            "balance_collective": spec["collective"],
            "balance_max_frozen_steps": 1000,
        },
    )
    parallel_config = config.parallel_config
    parallel_config.data_parallel_rank = parallel_config.data_parallel_rank_local = spec["rank"]
    parallel_config.data_parallel_master_ip = "127.0.0.1"
    parallel_config._data_parallel_master_port_list = [spec["start_port"]]
    if spec["role"] == "new":
        parallel_config._coord_store_port = spec["coord_port"]
    scheduler = factories.make_scheduler(vllm_balance.BalanceScheduler, config)
    executor = WorkerRpcStandIn()
    engine = _engine(config, scheduler, executor)
    records = []
    if spec["role"] != "new":
        for i, adds in enumerate(spec["before"]):
            records.append(_step(engine, adds, f"r{spec['rank']}-before-{i}"))
    _resize(engine, spec)
    if spec["role"] != "removing":
        for i, adds in enumerate(spec["after"]):
            records.append(_step(engine, adds, f"r{spec['rank']}-after-{i}"))
    return {
        "records": records,
        "rpcs": executor.calls,
        "dp_size": parallel_config.data_parallel_size,
        "frozen_streak": scheduler.balance_gate._frozen_streak,
    }


def rank_main(spec: dict) -> None:
    """Process target (forkserver child): ``run``, its result or error written for the test."""
    from tests.multiproc.rank import apply_inherited_mutant

    apply_inherited_mutant()
    try:
        result = {"ok": run(spec)}
    except BaseException as exc:  # reported to the test, which names the rank
        result = {"error": f"{type(exc).__name__}: {exc}"}
    with open(spec["result_file"], "w", encoding="utf-8") as out:
        json.dump(result, out)
