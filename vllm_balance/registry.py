"""Every run-time patch this package applies to vLLM, accounted for.

Above each entry a comment in vllm-ascend's patch convention says Why (what upstream lacks),
How (what is replaced), Related PR (the upstream change that would remove it) and Future Plan.
Each is reversible (``install()`` / ``uninstall()``), so tests can apply and remove it.
Scheduler classes are not patched: they are chosen per engine process through
``scheduler_config.scheduler_cls`` (see ``vllm_balance.activation``).

Each entry names what it installs: ``"module:name"``, imported when the entry is first installed
or compared (so this module imports nothing of the package, and ``activation`` / ``ascend`` may
import it), or the object itself. ``computed=True``: the name is a function that returns the
object, built from what the entry stands in front of. ``static=True``: installed as a
staticmethod. Nothing assigns an entry's replacement at import.

The take-over's entries, which put back the vLLM objects vllm-ascend's own balance patch
replaced, live with the rest of vllm-ascend's handling in ``vllm_balance/ascend/patches.py``.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def resolve(name: str) -> Any:
    """The object ``"package.module:attribute"`` names (the module imported if need be)."""
    return pkgutil.resolve_name(name)


_STATICS: dict[Any, staticmethod] = {}
_INSTALLED: list[RuntimePatch] = []  # in install order, for uninstall_all()


def _static(function: Any) -> staticmethod:
    # One staticmethod object per function, so is_current() can compare by identity.
    if isinstance(function, staticmethod):
        return function
    return _STATICS.setdefault(function, staticmethod(function))


@dataclass
class RuntimePatch:
    """One attribute of a vLLM object replaced at run time (its paperwork: the comment above it)."""

    name: str
    owner: Callable[[], Any]  # returns the object whose attribute is replaced
    attribute: str
    # What install() puts there: "module:name" (resolved once, on first use) or the object.
    replacement: Any
    computed: bool = False  # the replacement is a function returning the object to install
    static: bool = False  # installed as a staticmethod of the owner class
    _original: Any = field(default=None, repr=False)
    _resolved: tuple[Any, Any] | None = field(default=None, repr=False)  # (replacement, object)

    def resolved(self) -> Any:
        """The object install() puts there: the same object at every call while the state a
        computed replacement reads holds (``is_current()`` compares by identity)."""
        if self._resolved is None or self._resolved[0] is not self.replacement:
            named = self.replacement
            self._resolved = (named, resolve(named) if isinstance(named, str) else named)
        value = self._resolved[1]
        if self.computed:
            value = value()
        return _static(value) if self.static else value

    def current(self) -> Any:
        return self.owner().__dict__[self.attribute]

    def is_current(self) -> bool:
        """The attribute holds our replacement itself now (no other package has wrapped it)."""
        return self.current() is self.resolved()

    def install(self) -> None:
        if self.is_current():
            return
        self._original = self.current()
        setattr(self.owner(), self.attribute, self.resolved())
        if self not in _INSTALLED:
            _INSTALLED.append(self)

    def uninstall(self) -> None:
        # Only what install() put there: a take-over entry whose replacement is already in place
        # (nothing foreign to restore) was never installed and has nothing to give back.
        if self._original is not None and self.is_current():
            setattr(self.owner(), self.attribute, self._original)
            self._original = None
            _INSTALLED.remove(self)

    def is_applied(self) -> bool:
        """install() put the replacement there and nothing removed it; another package may have
        wrapped it since (then ``current()`` is theirs and calls ours)."""
        return self._original is not None

    def upstream(self) -> Any:
        """What the replacement stands in front of: what install() replaced, else what is there.

        Also after another package installed its own wrapper on top of ours (vllm-ascend's patches
        capture ``run_engine_core`` at import): what is there now is that wrapper, which calls
        ours, so calling it from ours would recurse forever.
        """
        value = self._original if self._original is not None else self.current()
        return value.__func__ if isinstance(value, staticmethod) else value


def engine_core_proc() -> Any:
    from vllm.v1.engine.core import EngineCoreProc

    return EngineCoreProc


def engine_core_module() -> Any:
    import vllm.v1.engine.core

    return vllm.v1.engine.core


# EngineCoreProc.run_engine_core
#   Why:
#     vLLM has no extension point to pick the DP engine-core class or the scheduler per config;
#     run_engine_core is the entry of every engine-core process and the first place that sees the
#     process's VllmConfig
#   How:
#     staticmethod wrapper (vllm_balance.activation.balance_run_engine_core) that validates the
#     config, swaps DPEngineCoreProc and selects the scheduler class when balance is on, restores
#     the upstream class when off, then calls upstream's run_engine_core
#   Related PR:
#     none yet: an engine-core hook for per-step DP collectives would remove it
#   Future Plan:
#     keep while the DP gather needs an engine-core subclass; drop with an upstream engine-core step
#     hook
RUN_ENGINE_CORE_WRAPPER = RuntimePatch(
    name="EngineCoreProc.run_engine_core",
    owner=engine_core_proc,
    attribute="run_engine_core",
    replacement="vllm_balance.activation:balance_run_engine_core",
    static=True,
)

# vllm.v1.engine.core.DPEngineCoreProc
#   Why:
#     the balance gather must run right after _has_global_unfinished_reqs (lessons A and B), which
#     only an engine-core subclass can hook
#   How:
#     module-global name swapped to BalanceDPEngineCoreProc by the run_engine_core wrapper, per
#     engine process, only when balance is on; restored otherwise
#   Related PR:
#     none yet (same engine-core hook as above)
#   Future Plan:
#     drop with an upstream engine-core step hook
DP_ENGINE_CORE_SWAP = RuntimePatch(
    name="vllm.v1.engine.core.DPEngineCoreProc",
    owner=engine_core_module,
    attribute="DPEngineCoreProc",
    replacement="vllm_balance.shim.engine_core:BalanceDPEngineCoreProc",
)


def _core_engine_actor_manager() -> Any:
    from vllm.v1.engine.utils import CoreEngineActorManager

    return CoreEngineActorManager


def ray_backend_present() -> bool:
    """Whether Ray is installed and this vLLM has the Ray engine-core actor names the two Ray
    entries replace: without Ray, vLLM cannot start the Ray DP backend, and the plugin changes
    nothing there."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return False
    import vllm.v1.engine.core as core
    import vllm.v1.engine.utils as utils

    return hasattr(utils, "CoreEngineActorManager") and hasattr(core, "DPMoEEngineCoreActor")


# vllm.v1.engine.utils.CoreEngineActorManager.__init__
#   Why:
#     with --data-parallel-backend ray the engine cores are Ray actors: run_engine_core never runs
#     there; the actor class is resolved in the API server, by this __init__, and Ray builds it in
#     each actor, so the API server is the one place that can choose it, with the config in hand
#   How:
#     wrapper (vllm_balance.activation.balance_actor_manager_init) that validates the config and
#     installs the DPMoEEngineCoreActor swap below when balance applies, removes it otherwise,
#     then calls upstream's __init__ (also scale_up_elastic_ep resolves the name again: same class)
#   Related PR:
#     none yet (same engine-core hook as above; an actor-class hook would also do)
#   Future Plan:
#     drop with an upstream engine-core step hook
RAY_ACTOR_MANAGER_WRAPPER = RuntimePatch(
    name="vllm.v1.engine.utils.CoreEngineActorManager.__init__",
    owner=_core_engine_actor_manager,
    attribute="__init__",
    replacement="vllm_balance.activation:balance_actor_manager_init",
)

# vllm.v1.engine.core.DPMoEEngineCoreActor
#   Why:
#     DPMoEEngineCoreActor's bases are bound when vLLM's module is defined: the DPEngineCoreProc
#     swap does not reach it, so a Ray engine core would never gather (balance silently absent)
#   How:
#     module-global name swapped (in the API server, by the wrapper above) to
#     BalanceDPMoEEngineCoreActor, a subclass of vLLM's actor with BalanceDPEngineCoreProc in its
#     MRO; Ray pickles the class by reference, so each actor imports it from this package, and its
#     __init__ activates (scheduler class, log line) before upstream's __init__ runs
#   Related PR:
#     none yet (same engine-core hook as above)
#   Future Plan:
#     drop with an upstream engine-core step hook
RAY_ACTOR_SWAP = RuntimePatch(
    name="vllm.v1.engine.core.DPMoEEngineCoreActor",
    owner=engine_core_module,
    attribute="DPMoEEngineCoreActor",
    replacement="vllm_balance.ray_actor:BalanceDPMoEEngineCoreActor",
)


def _engine_core_outputs() -> Any:
    from vllm.v1.engine import EngineCoreOutputs

    return EngineCoreOutputs


_DECODED_WITH_BALANCE: list[dict] = []


def _annotations_with_balance_stats() -> dict:
    """``EngineCoreOutputs``' annotations with ``scheduler_stats: BalanceSchedulerStats | None``.

    One object (``is_current()`` compares by identity), made from upstream's at first use.
    """
    if not _DECODED_WITH_BALANCE:
        from vllm_balance.shim.metrics import BalanceSchedulerStats

        upstream = STATS_DECODED_WITH_BALANCE.upstream()
        replaced = {**upstream, "scheduler_stats": BalanceSchedulerStats | None}
        _DECODED_WITH_BALANCE.append(replaced)
    return _DECODED_WITH_BALANCE[0]


# vllm.v1.engine.EngineCoreOutputs.scheduler_stats (decoded type)
#   Why:
#     SchedulerStats has no field for a plugin's counters, and msgspec decodes a dataclass by its
#     declared fields only: the balance counters an engine core adds to its stats
#     (vllm_balance.shim.metrics) would be dropped by the API server's decoder, so a headless node's
#     ranks would never reach /metrics
#   How:
#     EngineCoreOutputs.__annotations__ replaced by a copy whose scheduler_stats is
#     BalanceSchedulerStats | None (SchedulerStats plus one optional field), by the plugin in the
#     API server's process when VLLM_BALANCE_METRICS=1 (config.METRICS_ENV_VAR; the plugin runs
#     before the config exists, so it cannot see whether balance is on, and with balance off no
#     vLLM object may change), before vLLM builds its engine client; it affects decoders built
#     after it (msgspec reads a Struct's field types once, at its first decoder); an engine that
#     sends no balance field decodes with balance=None
#   Related PR:
#     none yet: a SchedulerStats field for plugin counters would remove it
#   Future Plan:
#     drop with an upstream SchedulerStats extension field
STATS_DECODED_WITH_BALANCE = RuntimePatch(
    name="vllm.v1.engine.EngineCoreOutputs.scheduler_stats (decoded type)",
    owner=_engine_core_outputs,
    attribute="__annotations__",
    replacement=_annotations_with_balance_stats,
    computed=True,
)

ALL_PATCHES: tuple[RuntimePatch, ...] = (
    RUN_ENGINE_CORE_WRAPPER,
    DP_ENGINE_CORE_SWAP,
    RAY_ACTOR_MANAGER_WRAPPER,
    RAY_ACTOR_SWAP,
    STATS_DECODED_WITH_BALANCE,
)


def uninstall_all() -> None:
    """Every installed patch removed, the last installed first (what it replaced is then in
    place: ours come off before the take-over gives vllm-ascend its names back)."""
    for patch in reversed(list(_INSTALLED)):
        patch.uninstall()
