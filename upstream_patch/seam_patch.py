"""The seam series in upstream_patch/, read and applied without git.

``apply.py installed``, the neutrality tests and ``reach.py`` all need the same three things:
which series fits a given vLLM ``scheduler.py``, the patched (or, for an already-seamed vLLM, the
unpatched) text of that file, and a module loaded from such a text next to the installed one.

The applier here is deliberately strict, stricter than ``patch``: every hunk's context and removed
lines must match exactly (an offset is allowed, fuzz is not) and a file's new text is computed in
memory before anything is written, so a series either applies completely or not at all. A series
that applies in reverse means the file already carries that seam.

The series directories are named after the vLLM ref they were made from (``v0.24.0``); that
listing is the table of supported refs. No vLLM version is written anywhere else.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

PATCH_ROOT = Path(__file__).resolve().parent
SEAM_METHOD = "_should_stop_admitting_waiting"
SCHEDULER_PATH = "vllm/v1/core/sched/scheduler.py"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_VERSION_PART = re.compile(r"\d+|[a-z]+")


class PatchError(RuntimeError):
    """A series that does not apply; the message is one line, fit for a command-line error."""


@dataclass
class Hunk:
    old_start: int
    new_start: int
    lines: list[str] = field(default_factory=list)  # with their ' ', '-', '+' prefixes

    def side(self, keep: str) -> list[str]:
        """The hunk's lines on one side: ``keep`` is '-' for the old text, '+' for the new."""
        return [ln[1:] for ln in self.lines if ln[0] in (" ", keep)]


@dataclass
class FileDiff:
    path: str  # repository-relative, e.g. vllm/v1/core/sched/scheduler.py
    new_file: bool
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def is_test(self) -> bool:
        return self.path.startswith("tests/")

    @property
    def changed_lines(self) -> int:
        return sum(ln[0] in "+-" for h in self.hunks for ln in h.lines)


@dataclass
class Series:
    """One ref's patches, in order (``git am`` order)."""

    ref: str
    directory: Path
    patches: list[Path]

    def file_diffs(self, include_tests: bool = True) -> list[FileDiff]:
        diffs = [d for p in self.patches for d in parse_patch(p.read_text(encoding="utf-8"))]
        return [d for d in diffs if include_tests or not d.is_test]

    def scheduler_diffs(self) -> list[FileDiff]:
        return [d for d in self.file_diffs() if d.path == SCHEDULER_PATH]


def version_key(ref: str) -> tuple:
    """Sort key for refs like ``v0.25.1``: numeric parts compare as numbers."""
    return tuple(
        (0, int(p), "") if p.isdigit() else (1, 0, p) for p in _VERSION_PART.findall(ref.lower())
    )


def all_series(root: Path = PATCH_ROOT) -> list[Series]:
    """Every series directory under ``root`` (a directory holding ``*.patch``), oldest first."""
    found = []
    for directory in root.iterdir():
        patches = sorted(directory.glob("*.patch")) if directory.is_dir() else []
        if patches:
            found.append(Series(directory.name, directory, patches))
    return sorted(found, key=lambda s: version_key(s.ref))


def series_for_ref(ref: str, root: Path = PATCH_ROOT) -> Series | None:
    """The series made for ``ref`` (``0.24.0`` and ``v0.24.0`` both name ``v0.24.0/``)."""
    wanted = {ref, f"v{ref}", ref.removeprefix("v")}
    return next((s for s in all_series(root) if s.ref in wanted), None)


def parse_patch(text: str) -> list[FileDiff]:
    """The file diffs of one ``git format-patch`` mail (or of a plain ``git diff``)."""
    diffs: list[FileDiff] = []
    lines = text.splitlines(keepends=True)
    i = 0
    current: FileDiff | None = None
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            current = FileDiff(path=line.split(" b/", 1)[1].strip(), new_file=False)
            diffs.append(current)
        elif current is not None and line.startswith("new file mode"):
            current.new_file = True
        elif current is not None and (match := _HUNK_HEADER.match(line)):
            old_count = int(match.group(2) or 1)
            new_count = int(match.group(4) or 1)
            hunk = Hunk(old_start=int(match.group(1)), new_start=int(match.group(3)))
            # A hunk ends when both sides are complete; what follows (the next diff, or the
            # "-- " signature of a format-patch mail) is not part of it.
            while old_count > 0 or new_count > 0:
                i += 1
                body = lines[i]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    continue
                tag = body[0] if body[0] in " -+" else " "
                if body in ("\n", "\r\n"):  # an empty context line whose space was stripped
                    body = " " + body
                hunk.lines.append(body)
                old_count -= tag in " -"
                new_count -= tag in " +"
            current.hunks.append(hunk)
        i += 1
    return diffs


def apply_file_diff(text: str | None, diff: FileDiff, reverse: bool = False) -> str:
    """``text`` with ``diff`` applied (or reverted); raises PatchError if any hunk mismatches."""
    if diff.new_file:
        if reverse:
            return ""
        if text:
            raise PatchError(f"{diff.path} already exists; the series would create it")
        return "".join(diff.hunks[0].side("+")) if diff.hunks else ""
    if text is None:
        raise PatchError(f"{diff.path} does not exist")
    old_tag, new_tag = ("+", "-") if reverse else ("-", "+")
    result = text.splitlines(keepends=True)
    # Where the previous hunks landed relative to their headers: the next hunk is looked for
    # there first (the same rule as patch's offset, without its fuzz).
    shift = 0
    for hunk in diff.hunks:
        old = hunk.side(old_tag)
        header_start = (hunk.new_start if reverse else hunk.old_start) - 1
        position = _find_block(result, old, header_start + shift)
        if position is None:
            raise PatchError(
                f"{diff.path}: hunk at line {header_start + 1} does not match "
                f"({'reverse' if reverse else 'forward'})"
            )
        new = hunk.side(new_tag)
        result[position : position + len(old)] = new
        shift = position - header_start + len(new) - len(old)
    return "".join(result)


def _find_block(lines: list[str], block: list[str], hint: int) -> int | None:
    """Where ``block`` occurs in ``lines``: at ``hint`` if it matches there, else the nearest
    match. No fuzz: every line must be equal."""
    size = len(block)

    def matches(at: int) -> bool:
        return 0 <= at and at + size <= len(lines) and lines[at : at + size] == block

    if matches(hint):
        return hint
    for distance in range(1, len(lines) + 1):
        for at in (hint - distance, hint + distance):
            if matches(at):
                return at
        if hint - distance < 0 and hint + distance > len(lines):
            break
    return None


def apply_diffs(
    read: dict[str, str | None], diffs: list[FileDiff], reverse: bool = False
) -> dict[str, str]:
    """New texts for every path the diffs touch, computed in memory (nothing is written).

    ``read`` maps each path to its current text (None if absent). Reverse application undoes the
    diffs last first, as ``git revert`` of a series would.
    """
    texts: dict[str, str | None] = dict(read)
    for diff in reversed(diffs) if reverse else diffs:
        texts[diff.path] = apply_file_diff(texts.get(diff.path), diff, reverse=reverse)
    return {path: text for path, text in texts.items() if text is not None}


def scheduler_text(source: str, series: Series, reverse: bool = False) -> str:
    """``scheduler.py`` with the series' scheduler change applied (or reverted)."""
    return apply_diffs({SCHEDULER_PATH: source}, series.scheduler_diffs(), reverse)[SCHEDULER_PATH]


@dataclass(frozen=True)
class Match:
    series: Series
    already_seamed: bool


def match_series(source: str, preferred_ref: str | None = None) -> Match:
    """The series that fits ``scheduler.py`` text ``source``, and whether it is applied already.

    The series named after ``preferred_ref`` (the installed version) is tried first; then every
    other series, newest first, so a fork or a post-release build whose scheduler equals some
    release still finds its series. A series "fits" when it applies forward (not seamed yet) or in
    reverse (seamed already) without fuzz. Raises PatchError if none fits.
    """
    candidates = all_series()[::-1]
    preferred = series_for_ref(preferred_ref) if preferred_ref else None
    if preferred is not None:
        candidates = [preferred] + [s for s in candidates if s.ref != preferred.ref]
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
