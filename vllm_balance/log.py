"""The package logger: a child of vLLM's ``vllm`` logger, so it prints however vLLM logs.

vLLM configures only the ``vllm`` logger (its handler, level and format; ``propagate=False``), and
since 0.31 it does so late, in ``configure_logging()`` (from the CLI's arguments, and at the start
of each engine process), not at import. A logger of our own that copied ``vllm``'s handlers at
import found none there and printed nothing at INFO (the activation and stats lines were lost on
every vLLM newer than 0.30). As ``vllm.vllm_balance`` the records go through whatever ``vllm`` has
when they are emitted: ``VLLM_CONFIGURE_LOGGING=0`` (then on to the root logger, as vLLM's own),
``VLLM_LOGGING_CONFIG_PATH`` (a config naming ``vllm`` keeps its children enabled), the level and
JSON format alike. ``init_logger`` adds vLLM's ``warning_once`` / ``info_once``, so a warning about
the config prints once per process however often the config is read (``vllm_balance.config``).
"""

from __future__ import annotations

import logging
from typing import Any, cast

LOGGER_NAME = "vllm.vllm_balance"

try:
    from vllm.logger import init_logger

    logger = init_logger(LOGGER_NAME)
except ImportError:  # a script's --help without vLLM (upstream_patch/vllm-ascend/phase2a.py):
    # a plain logger; nothing that calls the *_once methods runs there.
    logger = cast(Any, logging.getLogger(LOGGER_NAME))
