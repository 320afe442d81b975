"""The one decision point between the seam (shim), the pause-state hold and the derived copy.

Like ``typing_extensions``, the condition is the feature itself, never a version string: the seam
can appear in a fork under any version number.
"""

from __future__ import annotations

import functools
import importlib
from typing import Literal

from vllm_balance.log import logger

SEAM_NAME = "_should_stop_admitting_waiting"
# The derived schedule() copy, for the vLLMs whose one-step PAUSED_NEW is not the contract's hold
# (compat/fingerprints.json says which). The day none is supported: delete compat/derive.py and
# compat/scheduler.py and set this to None (docs/design.md, "Deleting the derived copy").
PHASE_2A_FALLBACK: str | None = "vllm_balance.compat.scheduler"
PAUSE_STATE_MODULE = "vllm_balance.compat.pause_state"
Path = Literal["shim", "pause-state", "compat"]


def has_seam() -> bool:
    """Whether the installed vLLM's ``Scheduler`` has the Phase 2B seam (upstream_patch/)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    return hasattr(Scheduler, SEAM_NAME)


@functools.cache
def active_path() -> Path:
    """The path for the installed vLLM, logged once per process: ``"shim"`` where vLLM has the
    seam; else ``"pause-state"`` where a one-step ``PAUSED_NEW`` is the contract's hold, and
    ``"compat"`` (the derived copy) where it is not (compat/pause_state.py decides)."""
    import vllm

    path: Path = "shim"
    if not has_seam():
        from vllm_balance.compat.pause_state import PAUSE_STATE, hold_for_installed_vllm

        path = "pause-state" if hold_for_installed_vllm() == PAUSE_STATE else "compat"
    logger.info(
        "balance scheduling: vLLM %s %s Scheduler.%s; using the %s path",
        vllm.__version__,
        "has" if path == "shim" else "lacks",
        SEAM_NAME,
        path,
    )
    return path


@functools.cache
def balance_scheduler_classes() -> tuple[type, type]:
    """(balance ``Scheduler``, balance ``AsyncScheduler``) for the installed vLLM."""
    path = active_path()
    if path == "shim":
        from vllm_balance.shim.scheduler import BalanceAsyncScheduler, BalanceScheduler

        return BalanceScheduler, BalanceAsyncScheduler
    if path == "pause-state":
        module = importlib.import_module(PAUSE_STATE_MODULE)
        return module.PauseStateBalanceScheduler, module.PauseStateBalanceAsyncScheduler
    if PHASE_2A_FALLBACK is None:
        raise RuntimeError(
            f"balance scheduling needs Scheduler.{SEAM_NAME} (upstream_patch/) on this vLLM, "
            "whose PauseState.PAUSED_NEW is not the contract's hold (compat/fingerprints.json)"
        )
    fallback = importlib.import_module(PHASE_2A_FALLBACK)
    return fallback.CompatBalanceScheduler, fallback.CompatBalanceAsyncScheduler


def balance_counterpart(upstream_cls: type) -> type | None:
    """The balance class for vLLM's ``Scheduler`` or ``AsyncScheduler``; None for anything else.

    Mapping by identity of the class vLLM would build (instead of swapping module names) makes
    balance reach ``AsyncScheduler`` whatever the import order.
    """
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    sync_cls, async_cls = balance_scheduler_classes()
    counterparts: dict[type, type] = {Scheduler: sync_cls, AsyncScheduler: async_cls}
    return counterparts.get(upstream_cls)
