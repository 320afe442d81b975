"""Builders of real vLLM objects on a CPU-only machine (what the simulator runs on).

Everything here builds the genuine article from the installed vLLM: ``VllmConfig``, the
``Scheduler`` (or any subclass, such as ours), ``Request``s hashed with vLLM's sha256 block
hasher. The one thing that cannot exist without an accelerator is the model forward; it is
stood in by :func:`model_runner_output`, which fabricates the ``ModelRunnerOutput`` a model
runner would return for a ``SchedulerOutput`` (one sampled token per request whose prompt is
complete, nothing for a partial prefill chunk), so a scheduler can be stepped through
``schedule()`` / ``update_from_output()`` until its requests finish and free their blocks.

The simulator's clusters are made of these; the test suite builds on them too
(``testbed/balance_testbed/factories.py`` adds stepping and output comparison).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

BLOCK_SIZE = 16


@functools.cache
def tiny_model_dir(moe: bool = True) -> str:
    """Write a tiny HF config (no weights, no tokenizer) once per process and return its dir.

    A Mixtral-style config makes ``model_config.is_moe`` true, which is what makes
    ``run_engine_core`` build a ``DPEngineCoreProc`` (the only engine core that syncs DP ranks).
    ``architectures`` is set explicitly: newer vLLM rejects the ``MixtralModel`` name that a bare
    config writes.
    """
    from transformers import LlamaConfig, MixtralConfig

    common: dict[str, Any] = dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=8192,
    )
    if moe:
        config = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        config.architectures = ["MixtralForCausalLM"]
    else:
        config = LlamaConfig(**common)
        config.architectures = ["LlamaForCausalLM"]
    path = tempfile.mkdtemp(prefix=f"vllm-balance-{'moe' if moe else 'dense'}-")
    atexit.register(_remove_dir, path, os.getpid())
    config.save_pretrained(path)
    return path


def _remove_dir(path: str, owner_pid: int) -> None:
    # A forked child inherits the cached path and the atexit hook: only the creator removes it.
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


def make_vllm_config(
    *,
    moe: bool = True,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 4096,
    num_gpu_blocks: int = 10_000,
    enable_prefix_caching: bool = False,
    long_prefill_token_threshold: int = 0,
    data_parallel_size: int = 1,
    async_scheduling: bool | None = False,
    additional_config: dict | None = None,
    kv_transfer_config: Any = None,
    scheduler_cls: Any = None,
    max_num_active_seqs: int | None = None,
):
    """A real ``VllmConfig`` for a tiny local model on CPU.

    ``max_num_active_seqs`` (vLLM 0.31+: the WAITING loop's admission limit, below
    ``max_num_seqs``) is passed only when set, so older releases never see the key.
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=tiny_model_dir(moe),
        skip_tokenizer_init=True,
        dtype="float16",
        max_model_len=max_model_len,
        seed=0,
    )
    scheduler_kwargs: dict[str, Any] = dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
    )
    if scheduler_cls is not None:
        scheduler_kwargs["scheduler_cls"] = scheduler_cls
    if max_num_active_seqs is not None:
        scheduler_kwargs["max_num_active_seqs"] = max_num_active_seqs
    scheduler_config = SchedulerConfig(**scheduler_kwargs)
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        parallel_config=ParallelConfig(data_parallel_size=data_parallel_size),
        device_config=DeviceConfig(device="cpu"),
        additional_config=additional_config or {},
        kv_transfer_config=kv_transfer_config,
    )
    # The Scheduler asserts this is known; on a real engine the KV profiler sets it.
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    return vllm_config


def make_kv_cache_config(num_blocks: int):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def make_scheduler(
    scheduler_cls: type | None = None, vllm_config=None, log_stats: bool = False, **config_kwargs
):
    """A real scheduler (upstream ``Scheduler`` unless ``scheduler_cls`` is given).

    ``log_stats``: vLLM's stats collection (``make_stats()`` returns ``None`` without it).
    """
    from vllm.v1.structured_output import StructuredOutputManager

    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls  # noqa: N813
    if vllm_config is None:
        vllm_config = make_vllm_config(**config_kwargs)
    elif config_kwargs:
        raise TypeError("pass either vllm_config or config keyword arguments, not both")
    num_blocks = vllm_config.cache_config.num_gpu_blocks
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=make_kv_cache_config(num_blocks),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=log_stats,
    )


@functools.lru_cache(maxsize=1)
def block_hasher():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    # Python's hash() returns int and breaks block hashing; vLLM's sha256 is what serving uses.
    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK_SIZE, sha256)


@dataclass(frozen=True)
class RequestSpec:
    """What a request is, independent of any scheduler: build one Request per scheduler from it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_time: float = 0.0
    priority: int = 0


def prompt_token_ids(index: int, length: int) -> tuple[int, ...]:
    """Distinct prompts per request, so no two requests share a cached prefix by accident."""
    return tuple((index * 131 + j * 7) % 997 + 1 for j in range(length))


def make_request(spec: RequestSpec):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
    return Request(
        request_id=spec.request_id,
        prompt_token_ids=list(spec.prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        arrival_time=spec.arrival_time,
        priority=spec.priority,
        block_hasher=block_hasher(),
    )


def model_runner_output(scheduler_output, scheduler, token_id: int = 7):
    """Fabricate the ModelRunnerOutput a model runner returns for ``scheduler_output``.

    One sampled token for each scheduled request whose prompt is complete after this step
    (partial prefill chunks sample nothing, as in vLLM's GPU model runner).
    """
    req_ids = list(scheduler_output.num_scheduled_tokens)
    # schedule() has already advanced num_computed_tokens and set is_prefill_chunk
    # (_update_after_schedule), so "prompt complete after this step" reads directly.
    sampled = [
        [] if scheduler.requests[req_id].is_prefill_chunk else [token_id] for req_id in req_ids
    ]
    return runner_output(req_ids, sampled)


def runner_output(req_ids: list[str], sampled: list[list[int]]):
    """A ``ModelRunnerOutput`` of these requests' sampled tokens, in the release's form."""
    from vllm.v1.outputs import ModelRunnerOutput

    fields: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:  # to 0.33
        fields["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(**fields)
