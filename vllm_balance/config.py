"""The one place that reads whether balance scheduling is enabled.

Sources, first match wins:
1. vllm-ascend's ``AscendConfig`` when that package is importable and initialised (on Ascend it is
   the primary source and already folds in vllm-ascend's own deprecated env var handling);
2. ``additional_config.scheduler_config.enable_balance_scheduling`` (the nested form newer
   vllm-ascend uses), which wins over
3. ``additional_config.enable_balance_scheduling``;
4. the deprecated env var ``VLLM_ASCEND_BALANCE_SCHEDULING``, parsed here and nowhere else,
   with a deprecation warning.

Values must be real booleans (JSON ``true``/``false``); anything else is a ``ValueError`` naming
the key and the value, because a silently ignored ``"yes"`` is an outage waiting to happen.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("vllm_balance")

ENABLE_KEY = "enable_balance_scheduling"
DEPRECATED_ENV_VAR = "VLLM_ASCEND_BALANCE_SCHEDULING"
_ENV_TRUE = {"1", "true"}
_ENV_FALSE = {"0", "false", ""}
_UNSET = object()


def _checked_bool(where: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(
        f"{where} must be a boolean (JSON true or false), got {value!r} "
        f"of type {type(value).__name__}"
    )


def _additional_config(vllm_config: Any) -> dict:
    additional = getattr(vllm_config, "additional_config", None) or {}
    if not isinstance(additional, dict):
        return {}
    return additional


def _from_ascend_config() -> Any:
    """vllm-ascend's parsed value, or _UNSET where vllm-ascend is absent or not initialised."""
    try:
        from vllm_ascend.ascend_config import get_ascend_config  # type: ignore[import-not-found]
    except ImportError:
        return _UNSET
    try:
        ascend_config = get_ascend_config()
    except Exception:  # not initialised yet in this process: fall back to additional_config
        return _UNSET
    value = getattr(ascend_config, ENABLE_KEY, _UNSET)
    if value is _UNSET:
        scheduler_config = getattr(ascend_config, "scheduler_config", None)
        value = getattr(scheduler_config, ENABLE_KEY, _UNSET)
    return value


def _from_additional_config(vllm_config: Any) -> Any:
    additional = _additional_config(vllm_config)
    nested = additional.get("scheduler_config")
    if isinstance(nested, dict) and ENABLE_KEY in nested:
        return _checked_bool(f"additional_config.scheduler_config.{ENABLE_KEY}", nested[ENABLE_KEY])
    if ENABLE_KEY in additional:
        return _checked_bool(f"additional_config.{ENABLE_KEY}", additional[ENABLE_KEY])
    return _UNSET


def _from_deprecated_env() -> Any:
    raw = os.environ.get(DEPRECATED_ENV_VAR)
    if raw is None:
        return _UNSET
    normalized = raw.strip().lower()
    if normalized not in _ENV_TRUE | _ENV_FALSE:
        raise ValueError(
            f"{DEPRECATED_ENV_VAR} must be 0/1/true/false, got {raw!r}; "
            f"prefer additional_config.{ENABLE_KEY}"
        )
    logger.warning(
        "%s is deprecated; use --additional-config '{\"%s\": true}' instead",
        DEPRECATED_ENV_VAR,
        ENABLE_KEY,
    )
    return normalized in _ENV_TRUE


def balance_enabled(vllm_config: Any) -> bool:
    """Whether balance scheduling is requested for this config (see the module docstring)."""
    for source in (
        _from_ascend_config,
        lambda: _from_additional_config(vllm_config),
        _from_deprecated_env,
    ):
        value = source()
        if value is not _UNSET:
            return _checked_bool(ENABLE_KEY, value)
    return False
