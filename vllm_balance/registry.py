"""Every run-time patch this package applies to vLLM, accounted for.

Each entry says Why (what upstream lacks), How (what is replaced), Related PR (the upstream change
that would remove it) and Future Plan, and is reversible (``install()`` / ``uninstall()``), so
tests can apply and remove it. Scheduler classes are not patched: they are chosen per engine
process through ``scheduler_config.scheduler_cls`` (see ``vllm_balance.activation``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RuntimePatch:
    """One attribute of a vLLM object replaced at run time, with its paperwork."""

    name: str
    why: str
    how: str
    related_pr: str
    future_plan: str
    owner: Callable[[], Any]  # returns the object whose attribute is replaced
    attribute: str
    replacement: Callable[[], Any]  # returns the value installed
    _original: Any = field(default=None, repr=False)

    def current(self) -> Any:
        return self.owner().__dict__[self.attribute]

    def is_installed(self) -> bool:
        return self.current() is self.replacement()

    def install(self) -> None:
        if self.is_installed():
            return
        self._original = self.current()
        setattr(self.owner(), self.attribute, self.replacement())

    def uninstall(self) -> None:
        if self.is_installed():
            setattr(self.owner(), self.attribute, self._original)

    def upstream(self) -> Any:
        """The value vLLM itself defines (what install() replaced, or what is there now)."""
        value = self._original if self.is_installed() else self.current()
        return value.__func__ if isinstance(value, staticmethod) else value


def _engine_core_proc() -> Any:
    from vllm.v1.engine.core import EngineCoreProc

    return EngineCoreProc


def _engine_core_module() -> Any:
    import vllm.v1.engine.core

    return vllm.v1.engine.core


def _wrapper() -> Any:
    from vllm_balance import activation

    return _static_wrapper(activation.balance_run_engine_core)


_STATICS: dict[Any, staticmethod] = {}


def _static_wrapper(function: Any) -> staticmethod:
    # One staticmethod object per function, so is_installed() can compare by identity.
    return _STATICS.setdefault(function, staticmethod(function))


def _balance_dp_engine_core() -> Any:
    from vllm_balance.shim.engine_core import BalanceDPEngineCoreProc

    return BalanceDPEngineCoreProc


RUN_ENGINE_CORE_WRAPPER = RuntimePatch(
    name="EngineCoreProc.run_engine_core",
    why=(
        "vLLM has no extension point to pick the DP engine-core class or the scheduler per "
        "config; run_engine_core is the entry of every engine-core process and the first place "
        "that sees the process's VllmConfig"
    ),
    how=(
        "staticmethod wrapper (vllm_balance.activation.balance_run_engine_core) that validates "
        "the config, swaps DPEngineCoreProc and selects the scheduler class when balance is on, "
        "restores the upstream class when off, then calls upstream's run_engine_core"
    ),
    related_pr="none yet: an engine-core hook for per-step DP collectives would remove it",
    future_plan=(
        "keep while the DP gather needs an engine-core subclass; drop with an upstream "
        "engine-core step hook"
    ),
    owner=_engine_core_proc,
    attribute="run_engine_core",
    replacement=_wrapper,
)

DP_ENGINE_CORE_SWAP = RuntimePatch(
    name="vllm.v1.engine.core.DPEngineCoreProc",
    why=(
        "the balance gather must run right after _has_global_unfinished_reqs (lessons A and B), "
        "which only an engine-core subclass can hook"
    ),
    how=(
        "module-global name swapped to BalanceDPEngineCoreProc by the run_engine_core wrapper, "
        "per engine process, only when balance is on; restored otherwise"
    ),
    related_pr="none yet (same engine-core hook as above)",
    future_plan="drop with an upstream engine-core step hook",
    owner=_engine_core_module,
    attribute="DPEngineCoreProc",
    replacement=_balance_dp_engine_core,
)

ALL_PATCHES: tuple[RuntimePatch, ...] = (RUN_ENGINE_CORE_WRAPPER, DP_ENGINE_CORE_SWAP)


def uninstall_all() -> None:
    for patch in reversed(ALL_PATCHES):
        patch.uninstall()
