"""Balance scheduling for vLLM data-parallel MoE serving.

Every active engine step each DP rank all-gathers ``len(running)``; when any rank was at
``max_num_running_reqs``, every rank stops admitting WAITING requests for that step.

- ``active_path()``: ``"shim"`` (vLLM has the ``_should_stop_admitting_waiting`` seam),
  ``"pause-state"`` (a frozen step under vLLM's ``PAUSED_NEW``) or ``"compat"`` (the derived
  copy, vLLM 0.31), decided once by feature detection.
- ``BalanceScheduler`` / ``BalanceAsyncScheduler``: the classes the installed vLLM gets,
  constructible exactly like upstream's ``Scheduler`` / ``AsyncScheduler``.
- Enable it with ``--additional-config '{"enable_balance_scheduling": true}'`` (the package
  registers itself as a vLLM general plugin).

vLLM is imported lazily, so importing this package is cheap and safe in any process.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BalanceAsyncScheduler", "BalanceScheduler", "active_path"]


def active_path() -> str:
    from vllm_balance.selection import active_path as _active_path

    return _active_path()


def __getattr__(name: str) -> Any:
    if name in ("BalanceScheduler", "BalanceAsyncScheduler"):
        from vllm_balance.selection import balance_scheduler_classes

        sync_cls, async_cls = balance_scheduler_classes()
        return sync_cls if name == "BalanceScheduler" else async_cls
    raise AttributeError(f"module 'vllm_balance' has no attribute {name!r}")
