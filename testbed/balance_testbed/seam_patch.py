"""The seam series in upstream_patch/: which one fits a vLLM ``scheduler.py``, applied with git.

``apply.py``, ``make_series.py``, ``run_vllm_tests.py``, ``reach.py`` and the seam tests need the
same few things: the series, which of them fits a given ``scheduler.py`` and whether it is applied
already, and that file's text with the series applied or reverted. Applying is ``git apply``
(``--check``, ``-R``, ``--include``), on a scratch copy for a text and in place for an installed
tree (``git_apply``): every context line must match (an offset is allowed, fuzz is not), and a
series applies completely or not at all.

What a series is, and which release each one serves: upstream_patch/README.md and
``make_series.py``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from packaging.version import InvalidVersion, Version

from balance_testbed import REPO

PATCH_ROOT = REPO / "upstream_patch"
# The alternative to the seam alone: balance scheduling in vLLM itself (in-tree/README.md), on
# the seam of its release where it has one. Same layout: one directory of patches per ref.
IN_TREE_ROOT = PATCH_ROOT / "in-tree"
# The tests-only PR: vLLM's own tests of PAUSED_NEW at every admission site of the waiting loop,
# with the scheduler.py mutants (mutants/*.patch) they must kill (pause-tests/PR.md).
PAUSE_TESTS_ROOT = PATCH_ROOT / "pause-tests"
SEAM_METHOD = "_should_stop_admitting_waiting"
SCHEDULER_PATH = "vllm/v1/core/sched/scheduler.py"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
# The series adds its cases to vLLM's own scheduler tests; before 0.31 it also gives the test
# factory create_scheduler() the scheduler_cls parameter those cases use (0.31 added it).
SEAM_TEST_PATH = "tests/v1/core/test_scheduler.py"
TEST_UTILS_PATH = "tests/v1/core/utils.py"
TEST_PATHS = (SEAM_TEST_PATH, TEST_UTILS_PATH)
WHEEL_DIR = Path("/tmp/wheels")  # release wheels, kept between runs
# Release sdists (they carry vLLM's tests/), kept between runs.
CACHE = Path(os.environ.get("VLLM_BALANCE_CACHE", Path.home() / ".cache" / "vllm-balance"))
INDEX = os.environ.get("VLLM_BALANCE_INDEX", "https://pypi.org/simple")


class PatchError(RuntimeError):
    """A series that does not apply; the message is one line, fit for a command-line error."""


@dataclass(frozen=True)
class Series:
    """One ref's patches, in the order they are committed."""

    ref: str
    directory: Path
    patches: tuple[Path, ...]

    @property
    def version(self) -> Version:
        return Version(self.ref)


def all_series(root: Path = PATCH_ROOT) -> list[Series]:
    """Every series directory (one holding ``*.patch``) under ``root``, oldest first."""
    found = []
    for directory in root.glob("v[0-9]*"):  # not vllm-ascend/: that series is for vllm-ascend
        patches = tuple(sorted(directory.glob("*.patch")))
        if patches:
            found.append(Series(directory.name, directory, patches))
    return sorted(found, key=lambda s: s.version)


def serving_series(version: str, root: Path = PATCH_ROOT) -> Series | None:
    """The stored series that serves release ``version``: its own, else the nearest newer one
    (``make_series.py`` stores a release only where its text differs from that one's); None for
    a name that is no version (a branch, a commit)."""
    try:
        wanted = Version(version)
    except InvalidVersion:
        return None
    return next((s for s in all_series(root) if s.version >= wanted), None)


def in_tree_stack(version: str) -> list[Series]:
    """The series that make the in-tree branch for release ``version``: the in-tree series stored
    for exactly that release, after the seam series serving it where one does (it is then written
    against the seam's text); alone on a release past the seam (0.34 on); [] where there is none."""
    in_tree = next((s for s in all_series(IN_TREE_ROOT) if s.ref == f"v{version}"), None)
    seam = serving_series(version)
    return [] if in_tree is None else [seam, in_tree] if seam else [in_tree]


def pause_tests_series(version: str) -> Series | None:
    """The tests-only PR stored for exactly release ``version`` (its tests are written against
    that release's files), or None."""
    return next((s for s in all_series(PAUSE_TESTS_ROOT) if s.ref == f"v{version}"), None)


def mutants(series: Series) -> list[Series]:
    """The deliberately wrong ``scheduler.py`` changes stored beside ``series``
    (``mutants/<name>.patch``), each as a one-patch series named after its file."""
    found = sorted((series.directory / "mutants").glob("*.patch"))
    return [Series(patch.stem, patch.parent, (patch,)) for patch in found]


def stack_paths(stack: list[Series]) -> list[str]:
    """Every repository path the series of ``stack`` change, in order, but the files they create."""
    patches = [str(patch) for series in stack for patch in series.patches]
    summary = git_apply(PATCH_ROOT, "--summary", *patches).stdout.splitlines()
    created = {line.split()[-1] for line in summary if line.startswith(" create mode ")}
    paths = dict.fromkeys(path for series in stack for path in numstat(series))
    return [path for path in paths if path not in created]


def git_apply(tree: Path, *args: str) -> subprocess.CompletedProcess:
    """``git apply ARGS`` in ``tree``, treated as a plain directory.

    Inside a git work tree (a venv under a checkout, say) ``git apply`` would take paths relative
    to that repository and silently skip the ones outside the current directory; the ceiling stops
    it from finding any repository above ``tree``.
    """
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(Path(tree).resolve().parent))
    return git(tree, "apply", *args, env=env, check=False)


def first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0] if lines else "(no output)"


def git(
    repo: Path, *args: str, env: dict | None = None, check: bool = True, stdin: str = ""
) -> subprocess.CompletedProcess:
    """``git -C repo ARGS``; with ``check``, a failure raises PatchError with git's first line."""
    result = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, input=stdin
    )
    if check and result.returncode != 0:
        raise PatchError(f"git {' '.join(args)}: {first_line(result.stderr or result.stdout)}")
    return result


def commit_message(patch: Path) -> str:
    """The message a patch file starts with (``make_series.py`` writes it above ``---``)."""
    return patch.read_text(encoding="utf-8").split("\n---\n", 1)[0] + "\n"


def apply_series(
    files: dict[str, str], series: Series, reverse: bool = False, include: str | None = None
) -> dict[str, str]:
    """The texts after applying (or reverting) ``series`` to ``files`` (repository path -> text).

    Only paths matching ``include`` (a ``git apply --include`` pattern) are touched. Computed in a
    scratch directory; nothing is written elsewhere. Raises PatchError with git's first line.
    """
    with tempfile.TemporaryDirectory(prefix="vllm-seam-apply-") as tmp:
        tree = Path(tmp)
        for rel, text in files.items():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_text(text, encoding="utf-8")
        options = (["-R"] if reverse else []) + ([f"--include={include}"] if include else [])
        result = git_apply(tree, *options, *map(str, series.patches))
        if result.returncode != 0:
            direction = "reverse" if reverse else "forward"
            raise PatchError(f"{series.ref} ({direction}): {first_line(result.stderr)}")
        return {
            path.relative_to(tree).as_posix(): path.read_text(encoding="utf-8")
            for path in tree.rglob("*")
            if path.is_file()
        }


def scheduler_text(source: str, series: Series, reverse: bool = False) -> str:
    """``scheduler.py`` text ``source`` with the series' scheduler change applied (or reverted)."""
    files = apply_series({SCHEDULER_PATH: source}, series, reverse, include=SCHEDULER_PATH)
    return files[SCHEDULER_PATH]


def added_lines(series: Series, path: str) -> list[str]:
    """The lines the series adds to ``path`` (keepends), in order: what is written by hand
    (``make_series.authored``) and the test cases it adds."""
    text = series.patches[0].read_text(encoding="utf-8")
    _, found, part = text.partition(f"\n+++ b/{path}\n")
    if not found:
        return []
    end = part.find("\ndiff --git ")
    part = part if end < 0 else part[: end + 1]
    return [line[1:] for line in part.splitlines(keepends=True) if line.startswith("+")]


def seam_test_names(series: Series, paths: tuple[str, ...] = (SEAM_TEST_PATH,)) -> list[str]:
    """The test functions the series adds to ``paths`` (vLLM's test_scheduler.py)."""
    added = "".join(line for path in paths for line in added_lines(series, path))
    return re.findall(r"^def (test_\w+)\(", added, re.M)


def numstat(series: Series) -> dict[str, tuple[int, int]]:
    """Lines added and removed per path (``git apply --numstat``)."""
    out = git_apply(PATCH_ROOT, "--numstat", *map(str, series.patches)).stdout
    counts: dict[str, tuple[int, int]] = {}
    for line in out.splitlines():
        added, removed, path = line.split("\t")
        before = counts.get(path, (0, 0))
        counts[path] = (before[0] + int(added), before[1] + int(removed))
    return counts


@dataclass(frozen=True)
class Match:
    series: Series
    already_seamed: bool


def match_series(source: str, version: str | None = None) -> Match:
    """The series that fits ``scheduler.py`` text ``source``, and whether it is applied already.

    The first series at or above ``version`` (the installed release: its own series, or the newer
    one that serves it) is tried first; then every other series, newest first, so a fork or a
    post-release build whose scheduler equals some release still finds its series. A series fits
    when it applies forward (not seamed yet) or in reverse (seamed already). Raises PatchError if
    none fits.
    """
    candidates = all_series()[::-1]
    serving = serving_series(version or "")
    if serving is not None:
        candidates = [serving] + [s for s in candidates if s != serving]
    for series in candidates:
        for reverse in (False, True):
            try:
                scheduler_text(source, series, reverse=reverse)
            except PatchError:
                continue
            return Match(series, already_seamed=reverse)
    raise PatchError(
        f"no series in {PATCH_ROOT} applies to this {SCHEDULER_PATH} "
        f"(tried {', '.join(s.ref for s in candidates) or 'none'})"
    )


def split_at_seam_method(source: str) -> tuple[str, str, str]:
    """``source`` as (before, the seam method, after); the method ends where the next one starts."""
    head, rest = source.split(f"    def {SEAM_METHOD}(", 1)
    body, tail = rest.split("\n    def ", 1)
    return head, f"    def {SEAM_METHOD}({body}\n", f"    def {tail}"


def wheel_for(version: str, package: str = "vllm") -> Path:
    """The release's wheel in WHEEL_DIR, downloaded (no dependencies) on first use."""
    WHEEL_DIR.mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    found = sorted(WHEEL_DIR.glob(f"{stem}-{version}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
             "-d", str(WHEEL_DIR), f"{package}=={version}"],
            check=True,
        )  # fmt: skip
        found = sorted(WHEEL_DIR.glob(f"{stem}-{version}-*.whl"))
    return found[0]


def unpacked_release(version: str, parent: Path | None = None) -> tuple[Path, Path]:
    """The release's wheel, and a new scratch directory (under ``parent``) it is unpacked into.

    First on a child's ``PYTHONPATH`` (``shadowing``), that tree shadows the vLLM of this
    environment without modifying it: the CPU runtime installed here is shared.
    """
    wheel = wheel_for(version)
    tree = Path(tempfile.mkdtemp(prefix=f"vllm-{version}-", dir=parent))
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tree)
    return wheel, tree


def shadowing(tree: Path) -> dict[str, str]:
    """This process's environment with ``tree`` first on ``PYTHONPATH``."""
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def vllm_index(package: str = "vllm") -> dict:
    """A package's page of the index in PEP 691's JSON form: its ``files`` and ``versions``."""
    request = urllib.request.Request(
        f"{INDEX}/{package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def fetch_sdist(version: str, package: str = "vllm") -> Path:
    """The cached sdist of ``package`` ``version`` (vLLM's, or vllm-ascend's for the take-over
    tests), downloaded from the index on first use.

    Through PEP 691's JSON form of the simple index (the interface pip itself uses), checked
    against the index's sha256. ``pip download`` cannot fetch it: it builds metadata first, and
    vLLM's metadata build fails without CUDA.
    """
    CACHE.mkdir(parents=True, exist_ok=True)
    target = CACHE / f"{package.replace('-', '_')}-{version}.tar.gz"
    if target.exists():
        return target
    entry = next((f for f in vllm_index(package)["files"] if f["filename"] == target.name), None)
    if entry is None:
        raise PatchError(f"the index has no {target.name}")
    digest = hashlib.sha256()
    # Per process: two reach runs of one release may download it at the same time.
    partial = target.with_suffix(f".{os.getpid()}.partial")
    with urllib.request.urlopen(entry["url"], timeout=300) as response, open(partial, "wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != entry["hashes"]["sha256"]:
        partial.unlink()
        raise PatchError(f"{target.name}: sha256 mismatch with the index")
    os.replace(partial, target)
    return target


def sdist_test_files(version: str) -> dict[str, str]:
    """The release's own test files the series changes (``TEST_PATHS``), from its sdist."""
    prefix = f"vllm-{version}/"
    with tarfile.open(fetch_sdist(version)) as tar:
        found = {
            member.name.removeprefix(prefix): member
            for member in tar
            if member.name.removeprefix(prefix) in TEST_PATHS
        }
        missing = set(TEST_PATHS) - set(found)
        if missing:
            raise PatchError(f"vllm-{version}.tar.gz has no {', '.join(sorted(missing))}")
        return {
            path: tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
            for path, member in found.items()
        }


def sdist_files(version: str, paths: list[str]) -> dict[str, str]:
    """Files of the release's sdist at repository paths ``paths`` (the ones it has)."""
    prefix = f"vllm-{version}/"
    wanted = {prefix + path for path in paths}
    with tarfile.open(fetch_sdist(version)) as tar:
        found = {m.name.removeprefix(prefix): m for m in tar if m.name in wanted}
        return {
            path: tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
            for path, member in found.items()
        }


def stack_files(version: str, stack: list[Series], vllm_root: Path | None = None) -> dict[str, str]:
    """What the series of ``stack`` change, as release ``version`` ships it: ``vllm/`` files from
    ``vllm_root`` (an installed or unpacked tree; default: the release's wheel), the rest from its
    sdist. Raises PatchError for a path neither has."""
    paths = stack_paths(stack)
    package = [p for p in paths if p.startswith("vllm/")]
    if vllm_root is None:
        with zipfile.ZipFile(wheel_for(version)) as archive:
            files = {p: archive.read(p).decode("utf-8") for p in package}
    else:
        files = {p: (vllm_root / p).read_text(encoding="utf-8") for p in package}
    files.update(sdist_files(version, [p for p in paths if not p.startswith("vllm/")]))
    missing = sorted(set(paths) - set(files))
    if missing:
        raise PatchError(f"vLLM {version} has no {', '.join(missing)}")
    return files


def release_files(version: str, scheduler_source: str | None = None) -> dict[str, str]:
    """What a series changes, as release ``version`` ships it: ``scheduler.py`` from its wheel
    (or ``scheduler_source``), the test files from its sdist (repository path -> text)."""
    if scheduler_source is None:
        scheduler_source = wheel_scheduler_source(wheel_for(version))
    return {SCHEDULER_PATH: scheduler_source, **sdist_test_files(version)}


def wheel_scheduler_source(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(SCHEDULER_PATH).decode("utf-8")


def installed_vllm_root() -> Path:
    """The directory that holds the installed ``vllm`` package (its parent, the site dir).

    Found with importlib's finder, which does not execute ``vllm/__init__.py``.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("vLLM is not installed in this interpreter")
    return Path(list(spec.submodule_search_locations)[0]).parent


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return ""


def load_scheduler_module(source: str, module_name: str) -> ModuleType:
    """Import a ``scheduler.py`` text as module ``module_name``, beside the installed one.

    vLLM's scheduler module uses absolute imports only, so a copy imports fine under another
    name; its ``Scheduler`` is a distinct class built from the given text. The text is written to
    a file so tracebacks and ``inspect`` show it.
    """
    if module_name in sys.modules:
        return sys.modules[module_name]
    directory = Path(tempfile.mkdtemp(prefix="vllm-balance-seam-"))
    path = directory / f"{module_name.replace('.', '_')}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def seam_stops_before_installed() -> str | None:
    """Why no seam test can run on the installed vLLM, or None: it is newer than every stored
    series (the seam stops at 0.33: pins/seam-verified.txt). A release a series should serve and
    does not fit stays a failure."""
    version = installed_version()
    newest = all_series()[-1].ref if all_series() else "none"
    try:
        Version(version)
    except InvalidVersion:
        return None
    if serving_series(version) is None:
        return (
            f"no seam series serves vLLM {version} (the newest is {newest}: the seam stops there)"
        )
    return None
