"""vllm-ascend's ``AscendConfig``: the first source of the enable key where it is initialised.

vllm-ascend parses ``additional_config`` itself (``init_ascend_config``); where it has, this
package reads the value vllm-ascend acts on, so the two cannot disagree (``vllm_balance.config``).
"""

from __future__ import annotations

from typing import Any


def enable_value(key: str) -> tuple[bool, Any]:
    """``(True, value)`` of ``key`` in vllm-ascend's parsed ``AscendConfig`` (vllm-ascend <= 0.24
    at the top level, later releases under ``scheduler_config``); ``(False, None)`` where
    vllm-ascend is absent, not initialised in this process, or has no such field."""
    try:
        from vllm_ascend.ascend_config import get_ascend_config  # optional: Ascend hosts only
    except ImportError:
        return False, None
    try:
        ascend_config = get_ascend_config()
    except Exception:  # not initialised yet in this process: the caller reads additional_config
        return False, None
    for owner in (ascend_config, getattr(ascend_config, "scheduler_config", None)):
        if owner is not None and hasattr(owner, key):
            return True, getattr(owner, key)
    return False, None
