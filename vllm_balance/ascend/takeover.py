"""Take-over mode: run this package where vllm-ascend's own balance patch is active.

vllm-ascend (until it delegates, ``upstream_patch/vllm-ascend/``) applies
``vllm_ascend/patch/platform/patch_balance_schedule.py`` with all its platform patches, in every
process that loads its plugins, and reads the same ``enable_balance_scheduling`` key. At import
that module swaps ``vllm.v1.core.sched.scheduler.Scheduler`` for its ``BalanceScheduler`` (a copy
of v0.24.0's ``schedule()``) and wraps ``EngineCoreProc.run_engine_core`` (the wrapper swaps
``DPEngineCoreProc`` when balance is on); its DyntraLB patch wraps ``run_engine_core`` once more.
vllm-ascend offers no switch to leave them out.

Without ``balance_take_over_vllm_ascend`` this package steps aside next to it: vllm-ascend's
balance runs as it ships it and this package installs nothing (``next_to_vllm_ascend``); its
ShortRequestFirst and DyntraLB are then untouched. With it, where vllm-ascend still ships a copy of
``schedule()`` (``vllm_ascend_copies_schedule``; a vllm-ascend whose ``BalanceScheduler`` holds on
vLLM's ``PAUSED_NEW`` has nothing this mode would fix, and it is refused), the engine-core process
gets vLLM's own objects back through ``patches.TAKE_OVER_PATCHES`` (reversible; their
replacements are the ``vllm_*`` functions below) before this package activates as it does
anywhere else. vLLM's objects are found from what replaced them or from vLLM's own source, never
from vllm-ascend's private names: a swapped class still has vLLM's class in its MRO; vLLM's
``run_engine_core`` is rebuilt from vLLM's module (``vllm_run_engine_core``).

When vllm-ascend's patches land in a process depends on plugin order. vLLM loads general plugins
(ours and vllm-ascend's, in entry-point order) in the front end, before the platform hook; in a
spawned engine core, inside ``EngineCore.__init__``, after ``run_engine_core`` chose the
engine-core class. ``prepare_vllm_ascend()`` applies them first (what vllm-ascend's own
``adapt_patch(is_global_patch=True)`` does; idempotent), so that what this package checks,
restores and stacks its wrapper on is the final state, whatever the order.

What vllm-ascend's removed code did besides balance is done here or refused: its
``AscendConfig`` is initialised in the engine core (``init_vllm_ascend_config``, as its
``BalanceScheduler.__init__`` did up to 0.27.1rc1 and its ``run_engine_core`` wrapper does from
0.30.0rc2; other vllm-ascend code calls ``get_ascend_config()`` there), and the features that live
in what the take-over removes (ShortRequestFirst's queue, DyntraLB's engine core) are refused
under the take-over only (an operator's explicit choice, named in the error).
Tested against vllm-ascend's own released source: ``tests/test_takeover.py``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import types
from types import ModuleType
from typing import TYPE_CHECKING, Any

from vllm_balance import registry
from vllm_balance.ascend.patches import (
    TAKE_OVER_PATCHES,
    async_scheduler_module,
    scheduler_module,
)
from vllm_balance.config import (
    TAKE_OVER_ENV_VAR,
    TAKE_OVER_KEY,
    BalanceConfigError,
    BalanceOptions,
    additional_value,
)
from vllm_balance.log import logger
from vllm_balance.registry import RUN_ENGINE_CORE_WRAPPER

if TYPE_CHECKING:
    from vllm.config import VllmConfig

VLLM_ASCEND = "vllm_ascend"
# vllm_ascend/utils.py adapt_patch(is_global_patch=True) imports this package; its __init__
# imports every platform patch, patch_balance_schedule and patch_dyntra_lb_core among them.
VLLM_ASCEND_PLATFORM_PATCHES = "vllm_ascend.patch.platform"
VLLM_ASCEND_CONFIG = "vllm_ascend.ascend_config"
VLLM_RUN_ENGINE_CORE = ("vllm.v1.engine.core", "EngineCoreProc.run_engine_core")
SHORT_REQUEST_FIRST_KEY = "short_request_first_config"
DYNTRA_LB_KEY = "dyntra_lb_config"
# vllm-ascend features whose code sits in what the take-over removes: (key, what is lost).
LOST_WITH_THE_TAKE_OVER = {
    SHORT_REQUEST_FIRST_KEY: "installs its waiting queue in the BalanceScheduler",
    DYNTRA_LB_KEY: "swaps in its engine core from the run_engine_core wrapper",
}


class TakeOverError(ValueError):
    """The take-over cannot give vLLM its objects back (the engine core must not start)."""


def is_vllm_ascend(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == VLLM_ASCEND or module.startswith(VLLM_ASCEND + ".")


def import_vllm_ascend_patches() -> None:
    """Apply vllm-ascend's platform patches now, where vllm-ascend is installed (idempotent)."""
    if importlib.util.find_spec(VLLM_ASCEND) is None:
        return
    try:
        importlib.import_module(VLLM_ASCEND_PLATFORM_PATCHES)
    except Exception as exc:  # vllm-ascend's own plugins fail the same way here; vLLM logs those
        logger.warning_once(
            "vllm-ascend is installed but %s cannot be imported here (%s); balance "
            "scheduling checks the vLLM names as they are",
            VLLM_ASCEND_PLATFORM_PATCHES,
            f"{type(exc).__name__}: {exc}",
            scope="process",
        )


def vllm_class(cls: type, module: str, name: str) -> type:
    """vLLM's own ``module.name`` behind ``cls``: the first class of its MRO defined there."""
    for candidate in cls.__mro__:
        if candidate.__module__ == module and candidate.__qualname__ == name:
            return candidate
    raise TakeOverError(f"{module}.{name} is {cls!r}, which does not derive from vLLM's {name}")


def clean_async_scheduler(cls: type) -> type:
    """``cls`` if no vllm-ascend class is in its MRO, else the same code run on vLLM's Scheduler.

    ``AsyncScheduler`` binds ``Scheduler`` when its module first runs; after vllm-ascend's swap
    (its platform imports its recompute scheduler, which imports ``AsyncScheduler``) its base is
    vllm-ascend's ``BalanceScheduler``. Executing the module's code again, into a new module
    object, with vLLM's ``Scheduler`` in place gives the class vLLM defines; the loaded module and
    every other name stay as they are.
    """
    if not any(is_vllm_ascend(base) for base in cls.__mro__):
        return cls
    return _rebuilt_async_scheduler(cls)


@functools.cache  # one class per swapped class: is_current() compares by identity
def _rebuilt_async_scheduler(cls: type) -> type:
    if is_vllm_ascend(scheduler_module().Scheduler):
        raise TakeOverError("AsyncScheduler cannot be rebuilt before Scheduler is restored")
    return _fresh_module(cls.__module__).AsyncScheduler


def _function(value: Any) -> Any:
    value = value.__func__ if isinstance(value, staticmethod) else value
    return value if callable(value) and hasattr(value, "__code__") else None


def is_vllm_run_engine_core(function: Any) -> bool:
    return (
        getattr(function, "__module__", None),
        getattr(function, "__qualname__", None),
    ) == VLLM_RUN_ENGINE_CORE


def _fresh_module(name: str) -> ModuleType:
    """Module ``name``'s code executed again into a new module object (not re-imported): the
    loaded module and every name in it stay as they are."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None, name
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    return fresh


def vllm_run_engine_core() -> Any:
    """vLLM's own ``EngineCoreProc.run_engine_core``: what ours stands in front of when that is
    vLLM's function, else vLLM's code for it rebuilt from vLLM's module (``_fresh_module``) and
    bound to the loaded module's globals, so that it reads the ``DPEngineCoreProc`` this package
    swaps. Never found through another package's wrappers: their private module globals are
    not an interface (vllm-ascend's names for them changed between its releases)."""
    below = RUN_ENGINE_CORE_WRAPPER.upstream()
    return below if is_vllm_run_engine_core(below) else _rebuilt_run_engine_core()


@functools.cache  # built once: is_current() compares by identity
def _rebuilt_run_engine_core() -> Any:
    module = registry.engine_core_module()
    built = _function(vars(_fresh_module(module.__name__).EngineCoreProc)["run_engine_core"])
    rebound = types.FunctionType(
        built.__code__, vars(module), built.__name__, built.__defaults__, built.__closure__
    )
    rebound.__kwdefaults__ = built.__kwdefaults__
    rebound.__qualname__ = built.__qualname__
    rebound.__doc__ = built.__doc__
    if not is_vllm_run_engine_core(rebound):
        raise TakeOverError(f"rebuilt {rebound.__qualname__} is not vLLM's run_engine_core")
    return rebound


def foreign_balance_patches() -> list[str]:
    """Upstream names that another package (vllm-ascend's own balance patch, DyntraLB) replaced.

    vllm-ascend's built-in balance scheduling swaps the module-level ``Scheduler`` and wraps
    ``run_engine_core`` (its DyntraLB patches the same places); two balance gates would gather
    twice per step and disagree on the freeze. For ``run_engine_core`` what counts is what our
    wrapper calls after deciding (a vllm-ascend wrapper there would swap ``DPEngineCoreProc``
    behind our back; the first function below ours, no walk through another package's private
    globals); a wrapper that called ours has already run, and what it swapped shows in the two
    class names.
    """
    core_module = registry.engine_core_module()
    candidates = {
        "vllm.v1.core.sched.scheduler.Scheduler": scheduler_module().Scheduler,
        "vllm.v1.engine.core.DPEngineCoreProc": core_module.DPEngineCoreProc,
        "EngineCoreProc.run_engine_core": RUN_ENGINE_CORE_WRAPPER.upstream(),
    }
    return [
        f"{name} -> {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
        for name, obj in candidates.items()
        if is_vllm_ascend(obj)
    ]


def vllm_ascend_copies_schedule() -> bool:
    """Whether vllm-ascend's swapped-in ``Scheduler`` carries its own copy of ``schedule()``: a
    scheduling loop (``while``) in its ``schedule``, what every release up to 0.30.0rc2 ships and
    the take-over exists to replace. Only its wrappers swapped (DyntraLB) or no source to read:
    judged as a copy, as every published release is."""
    import ast
    import inspect
    import textwrap

    cls = scheduler_module().Scheduler
    if not is_vllm_ascend(cls):
        return True
    owner = next(c for c in cls.__mro__ if "schedule" in vars(c))
    if not is_vllm_ascend(owner):  # vLLM's own schedule(), unchanged
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(vars(owner)["schedule"])))
    except (OSError, TypeError):
        return True
    return any(isinstance(node, ast.While) for node in ast.walk(tree))


def prepare_vllm_ascend(vllm_config: VllmConfig) -> list[str]:
    """vllm-ascend's side effects in this process, all of them, before balance is decided;
    returns ``foreign_balance_patches()``.

    Applies vllm-ascend's platform patches (wherever plugin order put them, so that what is
    checked is the final state), then, where its balance patch is active, initialises its
    ``AscendConfig`` (``init_vllm_ascend_config``). That comes before the decision because
    ``AscendConfig`` is the first source of the enable key (``vllm_balance.config``) and is read
    only once initialised: decided earlier, this package would read ``additional_config`` while
    vllm-ascend reads its own parsed value, and the two could disagree.
    """
    import_vllm_ascend_patches()
    foreign = foreign_balance_patches()
    if foreign:  # vllm-ascend's own code initialises it in this process, whichever decides
        init_vllm_ascend_config(vllm_config)
    return foreign


def init_vllm_ascend_config(vllm_config: VllmConfig) -> None:
    """vllm-ascend's ``init_ascend_config(vllm_config)`` in this engine core, as its own code does.

    Its balance patch did it in every engine core (0.27.1rc1: ``BalanceScheduler.__init__``, the
    scheduler of every process after its swap; 0.30.0rc2: first thing in its ``run_engine_core``
    wrapper); vllm-ascend's other code reads ``get_ascend_config()`` afterwards and raises
    ``RuntimeError`` when nothing initialised it. Called before this package reads its own
    config, so that it reads what vllm-ascend reads (``AscendConfig`` first).
    """
    if importlib.util.find_spec(VLLM_ASCEND) is None:
        return
    try:
        module = importlib.import_module(VLLM_ASCEND_CONFIG)
    except ImportError as exc:
        raise TakeOverError(
            f"vllm-ascend's balance patch is active but {VLLM_ASCEND_CONFIG} cannot be imported "
            f"({exc}): its AscendConfig cannot be initialised in the engine core"
        ) from exc
    module.init_ascend_config(vllm_config)


def next_to_vllm_ascend(
    vllm_config: VllmConfig, options: BalanceOptions, foreign: list[str]
) -> str | None:
    """Why this package steps aside where vllm-ascend's balance patch is active (``foreign``)
    and no take-over is asked for; None where nothing is foreign or the take-over proceeds.
    Raises ``TakeOverError`` for a take-over that would fix nothing or lose a feature."""
    if not foreign:
        return None
    if not options.take_over_vllm_ascend:
        # Theirs runs as they ship it: two gates would gather twice per step and disagree.
        return (
            "balance scheduling is already patched in by vllm-ascend ("
            + "; ".join(foreign)
            + "): vllm-ascend's own balance scheduling runs and this package installs nothing. "
            f"To run this package instead where vllm-ascend still ships a copy of schedule(), set "
            f"{TAKE_OVER_ENV_VAR}=1 (docs/operations.md, 'With vllm-ascend on Ascend')"
        )
    if not vllm_ascend_copies_schedule():
        raise TakeOverError(
            f"{TAKE_OVER_KEY}: vllm-ascend's BalanceScheduler copies no schedule() (it holds a "
            "frozen step on vLLM's own PauseState.PAUSED_NEW), so there is nothing to take over; "
            f"unset {TAKE_OVER_ENV_VAR} / {TAKE_OVER_KEY}"
        )
    for key, lost in LOST_WITH_THE_TAKE_OVER.items():
        _, value = additional_value(vllm_config, key)  # vllm-ascend's <key>.enabled
        if isinstance(value, dict) and value.get("enabled") is True:
            raise TakeOverError(
                f"{TAKE_OVER_KEY} cannot keep vllm-ascend's {key}: vllm-ascend {lost} that the "
                f"take-over removes. Disable {key} or the take-over"
            )
    return None


def take_over_if_requested(options: BalanceOptions, foreign: list[str]) -> None:
    """Take-over mode: the decision (``next_to_vllm_ascend``) let foreign patches through."""
    if not foreign:
        if options.take_over_vllm_ascend:
            logger.warning(
                "%s (or %s) is set but vllm-ascend's balance patch is not active in this "
                "process: nothing to take over (remove it)",
                TAKE_OVER_KEY,
                TAKE_OVER_ENV_VAR,
            )
        return
    take_over(foreign)
    left = foreign_balance_patches()
    if left:
        raise BalanceConfigError(
            "balance scheduling could not take over from vllm-ascend: " + "; ".join(left)
        )


def take_over(foreign: list[str]) -> None:
    """Give vLLM its objects back (reversibly) and put our wrapper on top; log one line.

    ``foreign`` is what ``prepare_vllm_ascend()`` found; the caller's decision refused what the
    take-over cannot keep (``LOST_WITH_THE_TAKE_OVER``) and the caller checks that nothing is left
    afterwards.
    """
    # Ours may sit on top of vllm-ascend's wrapper: take it off so that theirs is what the
    # take-over replaces, then put it back on vLLM's function.
    RUN_ENGINE_CORE_WRAPPER.uninstall()
    for patch in TAKE_OVER_PATCHES:
        patch.install()
    RUN_ENGINE_CORE_WRAPPER.install()
    logger.info(
        "balance scheduling takes over from vllm-ascend's own balance patch (%s): vLLM's "
        "Scheduler, AsyncScheduler, DPEngineCoreProc and run_engine_core restored (were: %s)",
        TAKE_OVER_KEY,
        "; ".join(foreign),
    )


# The take-over entries' replacements (TAKE_OVER_PATCHES), each the same object at every
# call while vLLM's names hold what they hold.


def vllm_scheduler() -> type:
    module = scheduler_module()
    return vllm_class(module.Scheduler, module.__name__, "Scheduler")


def vllm_async_scheduler() -> type:
    return clean_async_scheduler(async_scheduler_module().AsyncScheduler)


def vllm_dp_engine_core() -> type:
    module = registry.engine_core_module()
    return vllm_class(module.DPEngineCoreProc, module.__name__, "DPEngineCoreProc")
