"""The one decision point between the seam (shim) and the Phase 2A fallback (compat).

Like ``typing_extensions``, the condition is the feature itself, never a version string: the seam
can appear in a fork under any version number.
"""

from __future__ import annotations

import functools
import importlib
from typing import Literal

from vllm_balance.log import logger

SEAM_NAME = "_should_stop_admitting_waiting"
# The Phase 2A fallback for a vLLM without the seam. The day every supported vLLM has the seam:
# delete compat/ and set this to None (docs/design.md, "Deleting compat/").
PHASE_2A_FALLBACK: str | None = "vllm_balance.compat.scheduler"
Path = Literal["shim", "compat"]


def has_seam() -> bool:
    """Whether the installed vLLM's ``Scheduler`` has the Phase 2B seam (upstream_patch/)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    return hasattr(Scheduler, SEAM_NAME)


@functools.cache
def active_path() -> Path:
    """``"shim"`` where vLLM has the seam, ``"compat"`` otherwise; logged once per process."""
    import vllm

    path: Path = "shim" if has_seam() else "compat"
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
    if active_path() == "shim":
        from vllm_balance.shim.scheduler import BalanceAsyncScheduler, BalanceScheduler

        return BalanceScheduler, BalanceAsyncScheduler
    if PHASE_2A_FALLBACK is None:
        raise RuntimeError(
            f"balance scheduling needs Scheduler.{SEAM_NAME} (upstream_patch/); this vLLM lacks it"
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
