"""The factories of real vLLM objects, as test support outside tests/ imports them.

They still live in the product package (``vllm_balance/factories.py``) and are to move under
``tests/`` (issue 15); scripts outside tests/ (upstream_patch/) import them through this one
module, so that move changes this line only.
"""

from vllm_balance.factories import (  # noqa: F401
    BLOCK_SIZE,
    RequestSpec,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_runner_output,
    request_specs,
    tiny_model_dir,
)
