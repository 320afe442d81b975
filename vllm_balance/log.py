"""The package logger, printed through vLLM's own handler so lines look like engine logs.

vLLM configures only the ``vllm`` logger (``propagate=False``); a bare ``vllm_balance`` logger
would lose its INFO lines in an engine process. Sharing the handler keeps one format and lets
``VLLM_LOGGING_LEVEL`` apply; the logger still propagates, so test log capture sees it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_balance")


def _share_vllm_handlers() -> None:
    try:
        import vllm.logger  # noqa: F401  (configures the "vllm" logger on import)
    except ImportError:
        return
    vllm_logger = logging.getLogger("vllm")
    for handler in vllm_logger.handlers:
        if handler not in logger.handlers:
            logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(vllm_logger.level)


_share_vllm_handlers()
