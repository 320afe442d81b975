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

Lines emitted before vLLM configured logging in the process are held, not lost: the activation
runs in balance's ``run_engine_core`` wrapper, before upstream's ``run_engine_core`` configures
(0.31+), so its lines would meet no handler and Python's WARNING default. Until ``vllm`` (or the
root) has a handler the logger holds its INFO records (``_HeldUntilVllmConfigures``); the first
record after that, or ``release_held_records()`` (the engine core's ``__init__``, right after
vLLM configured), hands them to vLLM's logging at the level it configured. WARNING and above are
never held: Python's last-resort handler prints them meanwhile.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, cast

LOGGER_NAME = "vllm.vllm_balance"
HELD_MAX = 100  # records of a process that never configures logging: the newest are kept

try:
    from vllm.logger import init_logger

    logger = init_logger(LOGGER_NAME)
except ImportError:  # a script run without vLLM installed:
    # a plain logger; nothing that calls the *_once methods runs there.
    logger = cast(Any, logging.getLogger(LOGGER_NAME))


def _vllm_logging_configured() -> bool:
    return logging.getLogger("vllm").hasHandlers()


class _HeldUntilVllmConfigures(logging.Filter):
    """Holds the package's INFO records until vLLM's logging is configured in this process."""

    def __init__(self) -> None:
        super().__init__()
        self.held: collections.deque[logging.LogRecord] = collections.deque(maxlen=HELD_MAX)

    def filter(self, record: logging.LogRecord) -> bool:
        if not _vllm_logging_configured():
            if record.levelno >= logging.WARNING:
                return True
            self.held.append(record)
            return False
        self.release()
        return logging.getLogger("vllm").isEnabledFor(record.levelno)

    def release(self) -> None:
        """From now on the logger follows ``vllm``'s level; the held records at or above it go
        through vLLM's handlers, in order, with the time they were emitted."""
        logger.removeFilter(self)
        logger.setLevel(logging.NOTSET)
        vllm_logger = logging.getLogger("vllm")
        while self.held:
            record = self.held.popleft()
            if vllm_logger.isEnabledFor(record.levelno):
                logger.handle(_remade(record))


def _remade(record: logging.LogRecord) -> logging.LogRecord:
    """The record as if made now, by the record factory vLLM installs when it configures (0.34
    adds the process name its format needs), with the time it was emitted."""
    made = logging.getLogRecordFactory()(
        record.name, record.levelno, record.pathname, record.lineno, record.msg, record.args,
        record.exc_info, record.funcName, record.stack_info,
    )  # fmt: skip
    made.created, made.msecs = record.created, record.msecs
    made.relativeCreated = record.relativeCreated
    return made


def release_held_records() -> None:
    """Hand the held records to vLLM's logging if it is configured by now (else keep them)."""
    for found in list(logger.filters):
        if isinstance(found, _HeldUntilVllmConfigures) and _vllm_logging_configured():
            found.release()


if not _vllm_logging_configured():
    # INFO records must exist to be held: the effective level is the root's WARNING until then.
    logger.setLevel(logging.INFO)
    logger.addFilter(_HeldUntilVllmConfigures())
