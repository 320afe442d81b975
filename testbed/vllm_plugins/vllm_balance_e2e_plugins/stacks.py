"""Stack dumps on SIGUSR1 for every vLLM process that loads plugins (observation only).

When ``VLLM_BALANCE_E2E_STACK_DIR`` is set, each such process (front end, engine cores,
workers) registers ``faulthandler`` for SIGUSR1, writing all threads' stacks to
``<dir>/stacks-<pid>.txt``: a hung server can then say where each rank waits, as the harness's
ranks do (``tests/multiproc/rank.py``). One file per process because vLLM prefixes its log lines
in Python, while faulthandler writes to a raw file descriptor.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from pathlib import Path

STACK_DIR_ENV = "VLLM_BALANCE_E2E_STACK_DIR"
_files: list = []  # kept open for faulthandler for the life of the process


def register() -> None:
    directory = os.environ.get(STACK_DIR_ENV)
    if not directory or _files:
        return
    out = open(Path(directory) / f"stacks-{os.getpid()}.txt", "a")  # noqa: SIM115
    _files.append(out)
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
