"""vllm-ascend's own released source in a test process, in a chosen plugin order.

The source is the sdist of a release in ``pins/vllm-ascend.txt``, fetched from the package
registry (``seam_patch.fetch_sdist``) and unpacked once into the cache; what an Ascend host
would add is stood in (``testbed/ascend_standin/README.md``). A release's source runs only on the
vLLM it targets, so tests use ``release_for_installed_vllm()`` and skip with the reason elsewhere.

vllm-ascend registers a torch op when its platform patches are imported, and a second import in
one process fails: the test process never imports it. Each case is an engine core started the
way vLLM's launcher starts it (``engine_probe.launch_engine_core``): a fork child whose target is
``FrontEnd`` (it loads the general plugins as vLLM's front end does, then runs
``run_engine_core``; the child's memory is what a front end's fork child inherits), or a spawn
child, which loads vllm-ascend itself.

vLLM runs general plugins in ``importlib.metadata.entry_points()`` order, which follows
``sys.path``: the release's tree before site-packages loads vllm-ascend's plugins before ours,
after it loads ours first. Spawned children get the parent's ``sys.path``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from balance_testbed import REPO

STUBS_ROOT = REPO / "testbed" / "ascend_standin"
ORDERS = ("ascend-first", "ours-first")
OUR_PLUGIN = "balance_scheduling"
GENERAL_PLUGINS = "vllm.general_plugins"
_IDENTITY = ("-c", "user.name=vllm-balance tests", "-c", "user.email=tests@localhost")


def load_vllm_ascend_script(name: str):
    """A module of ``upstream_patch/vllm-ascend/`` (its folder name is not an import name)."""
    import importlib.util

    path = REPO / "upstream_patch" / "vllm-ascend" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"vllm_ascend_{name}", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def load_series_module():
    """``upstream_patch/vllm-ascend/series.py``."""
    return load_vllm_ascend_script("series")


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def release_for_installed_vllm():
    """The pinned vllm-ascend release (``pins.AscendPin``) that targets the installed vLLM, or
    None; ``skip_reason()`` says why not."""
    from balance_testbed.pins import read_vllm_ascend_pins

    version = installed_vllm_version()
    return next((pin for pin in read_vllm_ascend_pins() if pin.vllm == version), None)


def skip_reason() -> str:
    from balance_testbed.pins import read_vllm_ascend_pins

    pairs = ", ".join(f"{p.release} on vLLM {p.vllm}" for p in read_vllm_ascend_pins())
    return (
        f"no vllm-ascend release in pins/vllm-ascend.txt targets vLLM "
        f"{installed_vllm_version()} (pairs: {pairs}; nox -s takeover runs them)"
    )


def _cache() -> Path:
    from balance_testbed.seam_patch import CACHE

    return CACHE


def _vllm_tag(dockerfile: str) -> str:
    match = re.search(r"^ARG VLLM_TAG=v?(\S+)$", dockerfile, re.M)
    assert match, "the sdist's Dockerfile names no VLLM_TAG"
    return match.group(1)


def _general_plugins_only(entry_points: str) -> str:
    """The ``[vllm.general_plugins]`` section of an ``entry_points.txt``."""
    sections = re.split(r"(?m)^(?=\[)", entry_points)
    [section] = [s for s in sections if s.startswith(f"[{GENERAL_PLUGINS}]")]
    return section.rstrip() + "\n"


def series_for(release: str, pr: str) -> Path | None:
    """The series of pull request ``pr`` whose base is ``release`` (``v<release>/<pr>/``)."""
    directory = REPO / "upstream_patch" / "vllm-ascend" / f"v{release}" / pr
    return directory if directory.is_dir() else None


def sdist_tree(release: str, into: Path) -> Path:
    """The release's sdist unpacked under ``into`` as a one-commit git tree (its blob ids are
    the tag's, so the series' rewrites check out); returns the tree."""
    from balance_testbed.seam_patch import fetch_sdist

    with tarfile.open(fetch_sdist(release, "vllm-ascend")) as tar:
        tar.extractall(into, filter="data")
    [source] = [p for p in into.iterdir() if p.name.startswith("vllm_ascend-")]
    module = load_series_module()
    module.git(source, "init", "-q")
    module.git(source, "add", "-A")
    module.git(source, *_IDENTITY, "commit", "-qm", "sdist")
    return source


def prepared_root(release: str, vllm: str, series: Path | None = None) -> Path:
    """A directory to put on ``sys.path``: the release's ``vllm_ascend`` package with its
    ``_build_info.py``, and a dist-info carrying its general-plugin entry points. With
    ``series``, the series is applied first (``series.apply_series`` on the unpacked sdist made
    a git tree). Made once per release and series content, under the cache."""
    from balance_testbed.seam_patch import fetch_sdist

    key = release
    if series is not None:
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(series.glob("*.patch"))))
        key += f"-{series.name}-{digest.hexdigest()[:12]}"
    target = _cache() / f"vllm-ascend-{key}"
    if (target / "vllm_ascend").is_dir():
        return target
    sdist = fetch_sdist(release, "vllm-ascend")
    scratch = Path(tempfile.mkdtemp(prefix="vllm-ascend-", dir=_cache()))
    try:
        with tarfile.open(sdist) as tar:
            tar.extractall(scratch, filter="data")
        [source] = scratch.iterdir()
        tag = _vllm_tag((source / "Dockerfile").read_text())
        assert tag == vllm, f"vllm-ascend {release} targets vLLM {tag}, pins say {vllm}"
        if series is not None:
            apply_series_to_sdist(source, series)
        root = scratch / "root"
        root.mkdir()
        shutil.move(str(source / "vllm_ascend"), root / "vllm_ascend")
        (root / "vllm_ascend" / "_build_info.py").write_text('__device_type__ = "A2"\n')
        dist_info = root / f"vllm_ascend-{release}.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {release}\n"
        )
        entry_points = (source / "vllm_ascend.egg-info" / "entry_points.txt").read_text()
        (dist_info / "entry_points.txt").write_text(_general_plugins_only(entry_points))
        try:
            os.replace(root, target)
        except OSError:  # another process made it first
            assert (target / "vllm_ascend").is_dir(), target
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def root_from_tree(tree: Path) -> Path:
    """A directory to put on ``sys.path`` with a vllm-ascend work tree's ``vllm_ascend`` package
    as it is now (a checkout at any commit, a series applied) and its
    ``_build_info.py``; a new one per call, under the cache (the caller removes it)."""
    root = Path(tempfile.mkdtemp(prefix="vllm-ascend-tree-", dir=_cache()))
    shutil.copytree(tree / "vllm_ascend", root / "vllm_ascend")
    (root / "vllm_ascend" / "_build_info.py").write_text('__device_type__ = "A2"\n')
    return root


def apply_series_to_sdist(source: Path, series: Path) -> None:
    """The unpacked sdist as a one-commit git tree, then the series on it (all or nothing)."""
    module = load_series_module()
    module.git(source, "init", "-q")
    module.git(source, "add", "-A")
    module.git(source, *_IDENTITY, "commit", "-qm", "sdist")
    module.apply_series(source, _IDENTITY, module.patches(series))


def put_on_path(order: str, root: Path) -> None:
    """Make the release importable (with the stand-ins) and its entry points found, in
    ``order``."""
    assert order in ORDERS, order
    for path in (str(STUBS_ROOT), str(root)):
        if order == "ascend-first":
            sys.path.insert(0, path)
        else:
            sys.path.append(path)


@contextmanager
def on_path(order: str, root: Path):
    """``put_on_path`` for the duration (a spawn child inherits it); ``sys.path`` restored."""
    saved = list(sys.path)
    put_on_path(order, root)
    try:
        yield
    finally:
        sys.path[:] = saved


_BALANCE_LOG: list[str] = []


def record_balance_log() -> None:
    """Keep this process's balance log messages for the report (``vllm_name_facts``).

    A fork child of the test process would write them through a handler made under pytest's
    capture, whose buffer the child never flushes (it ends with ``os._exit``)."""
    import logging

    from vllm_balance.log import LOGGER_NAME

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _BALANCE_LOG.append(f"{record.levelname} {record.getMessage()}")

    logging.getLogger(LOGGER_NAME).addHandler(Recorder(logging.DEBUG))


def general_plugin_names() -> list[str]:
    from importlib.metadata import entry_points

    return [e.name for e in entry_points(group=GENERAL_PLUGINS)]


def qualified(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def is_vllm_ascend_name(name: str) -> bool:
    return name.startswith("vllm_ascend.")


def vllm_ascend_in(names: list[str]) -> list[str]:
    return [n for n in names if is_vllm_ascend_name(n)]


def vllm_ascend_patches() -> list[str]:
    """Every vLLM name that holds a vllm-ascend object in this process: its monkeypatches.

    Module attributes of the loaded ``vllm.*`` modules, and the attributes of the classes those
    modules define, as ``"<vllm name> -> <vllm-ascend object>"``.
    """

    def owner(value) -> str:
        try:  # lazy objects (e.g. mocks, proxies) may raise anything on attribute access
            return qualified(value)
        except Exception:
            return "?"

    found = set()
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("vllm.") or module is None:
            continue
        for name, value in list(vars(module).items()):
            if is_vllm_ascend_name(owner(value)):
                found.add(f"{module_name}.{name} -> {owner(value)}")
            if isinstance(value, type) and value.__module__ == module_name:
                for attribute, member in list(vars(value).items()):
                    member = getattr(member, "__func__", member)
                    if is_vllm_ascend_name(owner(member)):
                        found.add(f"{module_name}.{name}.{attribute} -> {owner(member)}")
    return sorted(found)


def _ascend_config() -> dict | None:
    """What ``get_ascend_config()`` gives in this process (None where vllm-ascend is absent)."""
    if "vllm_ascend" not in sys.modules:
        return None
    try:
        from vllm_ascend.ascend_config import get_ascend_config

        config = get_ascend_config()
    except Exception as exc:  # RuntimeError: "Ascend config is not initialized"
        return {"error": f"{type(exc).__name__}: {exc}"}
    scheduler_config = getattr(config, "scheduler_config", None)
    return {"enable_balance_scheduling": scheduler_config.enable_balance_scheduling}


def run_engine_core_reach(start) -> list:
    """The functions a call of ``start`` can pass through, ``start`` first (an observation for
    the reports; the package itself never walks another package's globals).

    Ours calls ``RUN_ENGINE_CORE_WRAPPER.upstream()``; vllm-ascend's wrappers (functions named
    ``*run_engine_core``, like vLLM's) call what they captured in module globals
    (``_OriginalRunEngineCore``, ``_PreviousRunEngineCore``, ``_UpstreamRunEngineCore`` at
    vllm-ascend 182b75ea). The walk stops at vLLM's own function.
    """
    from vllm_balance.registry import RUN_ENGINE_CORE_WRAPPER

    def function(value):
        value = value.__func__ if isinstance(value, staticmethod) else value
        return value if callable(value) and hasattr(value, "__code__") else None

    ours = function(RUN_ENGINE_CORE_WRAPPER.resolved())
    found: list = []
    todo = [function(start)]
    while todo:
        current = todo.pop(0)
        if current is None or current in found:
            continue
        found.append(current)
        if current is ours:
            todo.append(RUN_ENGINE_CORE_WRAPPER.upstream())
        elif is_vllm_ascend_name(qualified(current)):
            module = sys.modules.get(current.__module__)
            if module is not None:
                todo.extend(
                    function(v)
                    for v in vars(module).values()
                    if function(v) is not None and function(v).__name__.endswith("run_engine_core")
                )
    return found


def vllm_name_facts() -> dict:
    """Where the names balance scheduling cares about point in this process."""
    import vllm.v1.core.sched.async_scheduler as async_module
    import vllm.v1.core.sched.scheduler as scheduler_module
    import vllm.v1.engine.core as core_module

    from vllm_balance.registry import RUN_ENGINE_CORE_WRAPPER

    return {
        "Scheduler": qualified(scheduler_module.Scheduler),
        "AsyncScheduler_mro": [qualified(c) for c in async_module.AsyncScheduler.__mro__],
        "DPEngineCoreProc_mro": [qualified(c) for c in core_module.DPEngineCoreProc.__mro__],
        "run_engine_core_reach": [
            qualified(f) for f in run_engine_core_reach(RUN_ENGINE_CORE_WRAPPER.current())
        ],
        "vllm_ascend_patches": vllm_ascend_patches(),
        "ascend_config": _ascend_config(),
        "balance_log": list(_BALANCE_LOG),
    }


@dataclass(frozen=True)
class FrontEnd:
    """Fork-child target: vLLM's front end up to the launch, then the engine core.

    The front end loads the general plugins (vllm-ascend's apply its platform patches; ours
    installs the wrapper); ``init_ascend_config`` also initialises vllm-ascend's config there,
    as vllm-ascend's platform does in a real front end. Its facts go to ``<report>.front``. Then
    ``EngineCoreProc.run_engine_core`` as it is now: what the launcher would start.
    ``ours_first_installed`` installs our wrapper before vllm-ascend's patches are imported (they
    then capture it). ``fresh_async_scheduler``: ``AsyncScheduler``'s module is first imported
    after vllm-ascend's swap, as in a real vllm-ascend front end (its platform imports its
    recompute scheduler, which imports ``AsyncScheduler``); the test process imported it before.
    """

    order: str
    root: str
    report: str
    init_ascend_config: bool = False
    ours_first_installed: bool = False
    fresh_async_scheduler: bool = False

    def __call__(self, *args, **kwargs):
        import vllm.plugins

        from vllm_balance import registry

        registry.uninstall_all()  # the test process may hold ours: a front end starts clean
        record_balance_log()
        if self.fresh_async_scheduler:
            import vllm.v1.core.sched as sched_package

            sys.modules.pop("vllm.v1.core.sched.async_scheduler", None)
            sched_package.__dict__.pop("async_scheduler", None)
        put_on_path(self.order, Path(self.root))
        if self.ours_first_installed:
            registry.RUN_ENGINE_CORE_WRAPPER.install()
        vllm.plugins.plugins_loaded = False
        vllm.plugins.load_general_plugins()
        if self.fresh_async_scheduler:
            import vllm.v1.core.sched.async_scheduler  # noqa: F401
        if self.init_ascend_config:
            from vllm_ascend.ascend_config import init_ascend_config

            init_ascend_config(kwargs["vllm_config"])
        facts = {"plugins": general_plugin_names(), "names": vllm_name_facts()}
        Path(self.report + ".front").write_text(json.dumps(facts))
        from vllm.v1.engine.core import EngineCoreProc

        return EngineCoreProc.run_engine_core(*args, **kwargs)


def front_end_facts(report: str) -> dict:
    return json.loads(Path(report + ".front").read_text())


@dataclass(frozen=True)
class ProbedTarget:
    """Spawn-child target: the handshake probe, then ``run_engine_core`` (pickled by name, as the
    launcher pickles it). The probe cannot ride in ``additional_config`` here
    (``engine_probe.HandshakeProbe``'s usual carrier): vllm-ascend refuses keys it does not
    know there."""

    report: str
    run_engine_core: object
    load_general_plugins: bool = True

    def __call__(self, *args, **kwargs):
        from balance_testbed.engine_probe import install_probe

        install_probe(self.report, self.load_general_plugins)
        record_balance_log()
        return self.run_engine_core(*args, **kwargs)
