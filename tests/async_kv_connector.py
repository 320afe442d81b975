"""A KV connector whose loads are asynchronous: the remote KV store a CPU test machine lacks.

vLLM's scheduler talks to a connector's scheduler side only; that side is what this is (vLLM's own
scheduler tests stand in for it the same way). A request whose id starts with ``REMOTE`` has
its whole prompt in the "remote store", loaded asynchronously: the scheduler allocates its blocks,
parks it in ``WAITING_FOR_REMOTE_KVS`` and schedules it once a model runner output names it in
``finished_recving`` (``load_finished``). Every other request has nothing remote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

REMOTE = "kv-"


def kv_transfer_config() -> Any:
    """A ``KVTransferConfig`` selecting this connector (PD-mixed: ``kv_both``)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=AsyncLoadConnector.__name__,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
    )


def load_finished(runner_output: Any, *request_ids: str) -> Any:
    """``runner_output`` reporting the async KV loads of ``request_ids`` as finished."""
    from vllm.v1.outputs import KVConnectorOutput

    runner_output.kv_connector_output = KVConnectorOutput(finished_recving=set(request_ids))
    return runner_output


@dataclass
class AsyncLoadMetadata(KVConnectorMetadata):
    """What a worker side would be told: the requests scheduled new this step."""

    new_requests: list[str]


class AsyncLoadConnector(KVConnectorBase_V1):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple:
        if not request.request_id.startswith(REMOTE):
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def may_load_async(self, request: Any) -> bool:
        # vLLM 0.34+ (with --max-num-inflight-kv-loads): such a request queues in
        # async_kv_waiting and may start its load while the running batch is full.
        return request.request_id.startswith(REMOTE)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return AsyncLoadMetadata([r.req_id for r in scheduler_output.scheduled_new_reqs])

    # The worker side: never built here (the scheduler builds the SCHEDULER role only).
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError
