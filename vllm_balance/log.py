"""The package logger: vLLM's kind (``init_logger``), printed through vLLM's own handler.

``init_logger`` gives it vLLM's ``warning_once`` / ``info_once``, so a warning about the config
prints once per process however often the config is read (``vllm_balance.config``). vLLM
configures only the ``vllm`` logger (``propagate=False``); a bare ``vllm_balance`` logger would
lose its INFO lines in an engine process. Sharing the handler keeps one format and lets
``VLLM_LOGGING_LEVEL`` apply; the logger still propagates, so test log capture sees it.
"""

from __future__ import annotations

import logging
from typing import Any, cast

try:
    from vllm.logger import init_logger  # configures the "vllm" logger on import

    logger = init_logger("vllm_balance")
except ImportError:  # a script's --help without vLLM (upstream_patch/vllm-ascend/phase2a.py):
    # a plain logger; nothing that calls the *_once methods runs there.
    logger = cast(Any, logging.getLogger("vllm_balance"))


def _share_vllm_handlers() -> None:
    vllm_logger = logging.getLogger("vllm")
    for handler in vllm_logger.handlers:
        if handler not in logger.handlers:
            logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(vllm_logger.level)


_share_vllm_handlers()
