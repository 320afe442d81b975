"""The only fake in the multi-process harness: the model forward.

``StandInExecutor`` is a real ``vllm.v1.executor.abstract.Executor`` subclass, passed to vLLM as
``executor_class`` exactly like ``UniProcExecutor``: the engine core calls it through the same
``collective_rpc`` method names (``get_kv_cache_spec``, ``determine_available_memory``,
``initialize_from_config``, ``execute_model``, ``execute_dummy_batch`` ...), and every name is
answered by an in-process ``StandInWorker``.

What makes it a faithful stand-in for a DP MoE forward: ``execute_model`` (when tokens are
scheduled) and ``execute_dummy_batch`` each take part in exactly ONE all_reduce on a second gloo
group spanning the DP ranks, as an expert-parallel MoE layer does. A rank that skips its forward
therefore blocks every other rank in that collective, which is the mechanism behind both
deadlock lessons. Like vLLM's GPU model runner, a step with zero scheduled tokens returns an empty
output without running the forward (the engine core then runs a dummy batch instead).

Outputs are plausible: the worker keeps per-request state like a model runner's input batch and
samples one token for each request whose known tokens are all computed after this step (partial
prefill chunks sample nothing; a request resumed after preemption recomputes prompt + outputs).
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.serial_utils import run_method

from balance_sim.builders import runner_output
from tests.multiproc import records

BLOCK_SIZE = 16
KV_BLOCKS = 4096
SAMPLED_TOKEN = 7
# Seconds each real forward sleeps: a knob for fault tests that need a rank to be mid-step.
FORWARD_SECONDS_ENV = "VLLM_BALANCE_HARNESS_FORWARD_SECONDS"
# "<rank>:<n>": that rank stops itself with SIGSTOP right after its n-th forward's collective, so
# the next DP collective of every other rank is the balance gather (pick n % 32 != 0: on every
# 32nd step upstream's all_reduce in _has_global_unfinished_reqs comes first). A pause at a
# random moment would usually leave the others in the forward's collective instead.
PAUSE_AFTER_FORWARD_ENV = "VLLM_BALANCE_HARNESS_PAUSE_AFTER_FORWARD"


class StandInWorker:
    """Answers the worker RPCs the engine core makes; the forward is one EP-group all_reduce."""

    def __init__(self, vllm_config: Any) -> None:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        parallel_config = vllm_config.parallel_config
        self.cache_config = vllm_config.cache_config
        self.dp_rank = parallel_config.data_parallel_rank
        # NOTE: vLLM hands every DP-related process group its own port from the list the front
        # end sent in the handshake (ParallelConfig.get_next_dp_init_port); the engine core's DP
        # group took one before the executor exists, the "expert-parallel" group takes the next.
        port = parallel_config.get_next_dp_init_port()
        self.ep_group = stateless_init_torch_distributed_process_group(
            parallel_config.data_parallel_master_ip,
            port,
            parallel_config.data_parallel_rank,
            parallel_config.data_parallel_size,
            backend="gloo",
        )
        self.forward_seconds = float(os.environ.get(FORWARD_SECONDS_ENV, "0") or 0)
        pause_rank, _, pause_after = os.environ.get(PAUSE_AFTER_FORWARD_ENV, "").partition(":")
        self.pause_after_forward = int(pause_after) if pause_rank == str(self.dp_rank) else None
        self.forwards = 0
        # req_id -> [prompt length, tokens known (prompt + sampled), tokens computed]
        self.requests: dict[str, list[int]] = {}

    # ---- start-up RPCs (what a GPU worker answers after profiling) ----
    def get_kv_cache_spec(self) -> dict:
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        return {"layer": spec}

    def determine_available_memory(self) -> int:
        spec = self.get_kv_cache_spec()["layer"]
        return spec.page_size_bytes * KV_BLOCKS

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        return None

    def get_supported_tasks(self) -> tuple:
        return ("generate",)

    # vLLM 0.30+: EngineCore._initialize_kv_caches resolves one KV cache layout before profiling
    # memory: it asks every worker for the layouts its attention backends support
    # (get_supported_kv_cache_layouts), resolves one (resolve_kv_cache_layout) and publishes it
    # (set_kv_cache_layout). Earlier releases never call these two.
    def get_supported_kv_cache_layouts(self) -> list[str]:
        # vLLM's own answer for a worker whose backends declare nothing: the stand-in has no
        # attention layers, so no backend (WorkerBase would look them up in the model).
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        return [layout.name for layout in get_supported_kv_cache_layouts(())]

    def set_kv_cache_layout(
        self, layout_name: str, cp_kv_cache_interleave_size: Any = None
    ) -> None:
        # As WorkerBase does: record the layout on this process's config (0.33+ also sends the
        # context-parallel interleave size, which only a real model's KV cache would read).
        from vllm.v1.attention.backends.utils import record_kv_cache_layout

        record_kv_cache_layout(self.cache_config, layout_name)

    def supports_draft_weight_updates(self) -> bool:
        # 0.30+: the engine core's READY message carries it (0.33+ asks only when weight transfer
        # is configured). As WorkerBase: no draft model, nothing to update.
        return False

    # ---- the forward ----
    def _moe_collective(self) -> None:
        if self.forward_seconds:
            time.sleep(self.forward_seconds)
        dist.all_reduce(torch.ones(1, dtype=torch.int32), group=self.ep_group)
        self.forwards += 1
        if self.forwards == self.pause_after_forward:
            os.kill(os.getpid(), signal.SIGSTOP)  # the test sends SIGCONT

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        if scheduler_output.total_num_scheduled_tokens == 0:
            # As the GPU model runner: no tokens, no forward, no collective.
            return EMPTY_MODEL_RUNNER_OUTPUT
        for new in scheduler_output.scheduled_new_reqs:
            prompt_len = len(new.prompt_token_ids)
            self.requests[new.req_id] = [prompt_len, prompt_len, new.num_computed_tokens]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            if req_id in getattr(cached, "resumed_req_ids", ()):
                # Resumed after preemption: prompt and every sampled token are recomputed.
                state[1] = state[0] + cached.num_output_tokens[i]
            state[2] = cached.num_computed_tokens[i]
        self._moe_collective()
        records.append("exec", tokens=scheduler_output.total_num_scheduled_tokens)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            state = self.requests[req_id]
            state[2] += scheduler_output.num_scheduled_tokens[req_id]
            if state[2] >= state[1]:
                sampled.append([SAMPLED_TOKEN])
                state[1] += 1
            else:
                sampled.append([])
        return runner_output(req_ids, sampled)

    def sample_tokens(self, grammar_output: Any) -> None:
        # execute_model already returned the sampled tokens (the engine core only calls this when
        # execute_model returned None).
        return None

    def execute_dummy_batch(self) -> None:
        self._moe_collective()
        records.append("dummy")

    def take_draft_token_ids(self) -> None:
        return None

    # Pause and sleep (EngineCore.pause_scheduler / sleep / wake_up): the device work they ask
    # for (wait for the device, clear its caches, free and restore its memory) has nothing to
    # act on here.
    def synchronize_device(self) -> None:
        return None

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def sleep(self, level: int = 1) -> None:
        return None

    def wake_up(self, tags: Any = None) -> None:
        return None

    def harness_drain_records(self) -> list:
        return records.drain()

    def harness_engine_facts(self) -> dict:
        """What this engine process runs, read from the process itself (tests/entrypoint.py)."""
        import sys

        import vllm.v1.engine.core as engine_core_module

        from balance_testbed.vllm_ascend_standin import qualified, vllm_name_facts
        from vllm_balance.registry import DP_ENGINE_CORE_SWAP, RUN_ENGINE_CORE_WRAPPER

        # The engine core is not reachable from an executor (and gc.get_objects() misses it:
        # EngineCore.__init__ freezes the GC heap), but this utility call runs on the busy loop's
        # own stack, so the engine core is the ``self`` of a calling frame.
        core, frame = None, sys._getframe()
        while frame is not None and core is None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, engine_core_module.EngineCoreProc):
                core = candidate
            frame = frame.f_back
        scheduler = getattr(core, "scheduler", None)
        gate = getattr(scheduler, "balance_gate", None)
        return {
            "dp_rank": self.dp_rank,
            "pid": os.getpid(),
            "run_engine_core_wrapped": RUN_ENGINE_CORE_WRAPPER.is_current(),
            "module_dp_engine_core": engine_core_module.DPEngineCoreProc.__name__,
            "dp_engine_core_swapped": DP_ENGINE_CORE_SWAP.is_current(),
            "engine_core_cls": type(core).__name__ if core else None,
            "scheduler_cls": type(scheduler).__name__ if scheduler else None,
            "balance_dp_size": None if gate is None else gate.dp_size,
            "scheduler_has_dp_group": gate is not None and gate.group is not None,
            # Counted by balance_gather() itself, after its all_gather (None: no balance gate).
            "balance_gathers": None if gate is None else gate.stats.gathers,
            "engine_core_mro": [qualified(c) for c in type(core).__mro__] if core else [],
            "scheduler_mro": [qualified(c) for c in type(scheduler).__mro__] if scheduler else [],
            "names": vllm_name_facts(),
        }

    def shutdown(self) -> None:
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        if self.ep_group is not None:
            stateless_destroy_torch_distributed_process_group(self.ep_group)
            self.ep_group = None


class StandInExecutor(Executor):
    """``Executor`` with one in-process ``StandInWorker``; shaped like vLLM's UniProcExecutor."""

    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        self.worker = StandInWorker(self.vllm_config)

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        # Before 0.30 the base class also asks workers to compile/warm up here and reads
        # compilation times back; there is nothing to compile.
        self.collective_rpc("initialize_from_config", args=(kv_cache_configs,))

    def compile_or_warm_up_model(self) -> None:
        # 0.30+: the engine core asks for it after initialize_from_config; nothing to compile,
        # so no compilation times to propagate.
        return None

    def collective_rpc(  # type: ignore[override]
        self, method, timeout=None, args=(), kwargs=None, non_block=False, single_value=False
    ):
        result = run_method(self.worker, method, args, kwargs or {})
        value = result if single_value else [result]
        if not non_block:
            return value
        future: Future = Future()
        future.set_result(value)
        return future

    def execute_model(self, scheduler_output, non_block=False):  # type: ignore[override]
        return self.collective_rpc(
            "execute_model", args=(scheduler_output,), non_block=non_block, single_value=True
        )

    def sample_tokens(self, grammar_output, non_block=False):  # type: ignore[override]
        return self.collective_rpc(
            "sample_tokens", args=(grammar_output,), non_block=non_block, single_value=True
        )

    def take_draft_token_ids(self):  # type: ignore[override]
        return None

    def check_health(self) -> None:
        return None
