"""The vllm-ascend stand-in (tests/ascend_standin/) in a process, in a chosen plugin order.

vLLM runs general plugins in ``importlib.metadata.entry_points()`` order, which follows
``sys.path``: the stand-in's distribution before site-packages loads vllm-ascend's plugins (and
its balance patch) before ours, after it loads ours first. Spawned children get the parent's
``sys.path``, so the order holds in engine-core processes too.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STANDIN_ROOT = Path(__file__).resolve().parent / "ascend_standin"
ORDERS = ("ascend-first", "ours-first")
OUR_PLUGIN = "balance_scheduling"


def load_series_module():
    """``upstream_patch/vllm-ascend/series.py`` (its folder name is not an import name)."""
    import importlib.util

    path = STANDIN_ROOT.parent.parent / "upstream_patch" / "vllm-ascend" / "series.py"
    spec = importlib.util.spec_from_file_location("vllm_ascend_series", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def delegating_root(directory: Path) -> Path:
    """The stand-in after the vllm-ascend series: its balance module is the series' own text."""
    import shutil

    series = load_series_module()
    root = directory / "delegating"
    shutil.copytree(STANDIN_ROOT, root)
    (root / series.BALANCE_MODULE).write_text(series.post_image(series.BALANCE_MODULE))
    return root


def put_on_path(order: str, root: Path = STANDIN_ROOT) -> None:
    """Make the stand-in importable and its entry points discoverable, in ``order``."""
    assert order in ORDERS, order
    if order == "ascend-first":
        sys.path.insert(0, str(root))
    else:
        sys.path.append(str(root))


def general_plugin_names() -> list[str]:
    from importlib.metadata import entry_points

    return [e.name for e in entry_points(group="vllm.general_plugins")]


def qualified(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def vllm_name_facts() -> dict:
    """Where the names balance scheduling cares about point in this process."""
    import vllm.v1.core.sched.async_scheduler as async_module
    import vllm.v1.core.sched.scheduler as scheduler_module
    import vllm.v1.engine.core as core_module

    from vllm_balance.registry import RUN_ENGINE_CORE_WRAPPER
    from vllm_balance.takeover import run_engine_core_reach

    return {
        "Scheduler": qualified(scheduler_module.Scheduler),
        "AsyncScheduler_mro": [qualified(c) for c in async_module.AsyncScheduler.__mro__],
        "DPEngineCoreProc_mro": [qualified(c) for c in core_module.DPEngineCoreProc.__mro__],
        "run_engine_core_reach": [
            qualified(f) for f in run_engine_core_reach(RUN_ENGINE_CORE_WRAPPER.current())
        ],
    }


def vllm_ascend_in(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("vllm_ascend.")]


@contextmanager
def vllm_ascend_in_this_process(order: str, root: Path = STANDIN_ROOT) -> Iterator[None]:
    """The stand-in on ``sys.path`` for one in-process test; afterwards every name as before.

    The test starts from vLLM's own names (a wrapper an earlier test left installed is taken off
    for its duration and put back afterwards, with what it had replaced). vLLM's
    ``plugins_loaded`` flag is cleared so that ``load_general_plugins()`` runs again.
    """
    import vllm.plugins
    import vllm.v1.core.sched.async_scheduler as async_module
    import vllm.v1.core.sched.scheduler as scheduler_module
    import vllm.v1.engine.core as core_module

    from vllm_balance import registry, takeover

    patches = registry.ALL_PATCHES + registry.TAKE_OVER_PATCHES
    saved = (
        scheduler_module.Scheduler,
        async_module.AsyncScheduler,
        core_module.DPEngineCoreProc,
        core_module.EngineCoreProc.__dict__["run_engine_core"],
    )
    saved_originals = [patch._original for patch in patches]
    saved_path, saved_loaded = list(sys.path), vllm.plugins.plugins_loaded
    registry.uninstall_all()
    put_on_path(order, root)
    vllm.plugins.plugins_loaded = False
    try:
        yield
    finally:
        registry.uninstall_all()
        for patch, original in zip(patches, saved_originals):
            patch._original = original
        takeover._rebuilt_async_schedulers.clear()
        (
            scheduler_module.Scheduler,
            async_module.AsyncScheduler,
            core_module.DPEngineCoreProc,
            run_engine_core,
        ) = saved
        core_module.EngineCoreProc.run_engine_core = run_engine_core
        sys.path[:] = saved_path
        vllm.plugins.plugins_loaded = saved_loaded
        for name in [m for m in sys.modules if m == "vllm_ascend" or m.startswith("vllm_ascend.")]:
            del sys.modules[name]
