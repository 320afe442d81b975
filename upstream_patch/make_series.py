"""Regenerate (or check) the seam series for vLLM releases.

    python upstream_patch/make_series.py 0.24.0 0.25.0 ...          # wheels from /tmp/wheels or pip
    python upstream_patch/make_series.py --check 0.24.0 0.25.0 ...

For each version: take ``vllm/v1/core/sched/scheduler.py`` from that release's wheel, apply the
seam (below), add the unit test, and write the commit message followed by the diff (``git diff
--patch-with-stat --full-index``) to ``upstream_patch/v<version>/seam.patch``. The message and the
unit test are written once, in the newest stored series; an older release gets them with its own
note on the condition and without the cases its default does not read (``authored``). No author,
date or ``Signed-off-by`` is written: ``apply.py git`` commits with the submitter's own git
identity, and the submitter signs off. Regenerating an unchanged release reproduces the same bytes.

A release's series is stored only where it differs: if the nearest newer stored series applies to
this release's ``scheduler.py`` and gives byte for byte what the generator gives, that series
serves this release too and no directory is written (and a stored older series that the new one
now covers is removed). ``--check`` regenerates each version and compares it, byte for byte, with
the stored series that serves it.

The seam is an "extract method" refactoring done mechanically, which is what lets one generator
follow the WAITING loop across releases: the one ``if <cond>: break`` in ``schedule()`` whose
condition reads ``self.max_num_*_reqs`` (the check in the WAITING loop on the request-slot limit:
``max_num_running_reqs`` up to 0.30, ``max_num_active_reqs`` from 0.31) moves, together with the
comment and assignment lines directly above it, into ``Scheduler._should_stop_admitting_waiting``;
the loop calls the method. One normalization: an ``==`` slot check becomes ``>=`` (equivalent,
since ``schedule()`` asserts ``len(self.running) <= max_num_running_reqs``; and the default stays a
stop should a subclass ever let running exceed the limit). The generator refuses a release where a
moved assignment is read later in ``schedule()``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seam_patch import (  # noqa: E402
    PATCH_ROOT,
    SCHEDULER_PATH,
    SEAM_METHOD,
    SEAM_TEST_PATH,
    PatchError,
    Series,
    all_series,
    apply_series,
    commit_message,
    git,
    seam_test_text,
    serving_series,
    split_at_seam_method,
    wheel_for,
    wheel_scheduler_source,
)

PATCH_NAME = "seam.patch"
# The sentence of the authored message that a release's note on its condition follows.
NOTE_AFTER = "No behaviour change."
# Test cases a release gets only where its default reads a field: a word only that case uses ->
# the field.
STREAMING_CASE = "resumable"
RELEASE_CASES = {
    STREAMING_CASE: "num_waiting_for_streaming_input",
    "max_num_active_seqs": "max_num_active_reqs",
}

EQ_NOTE = """

The inline check was `==`; the method uses `>=`, which is equivalent here
because len(self.running) <= self.max_num_running_reqs always holds
(schedule() asserts it), and it keeps the default a stop if a subclass ever
lets running exceed the limit."""

_SLOT_CHECK = re.compile(r"^(?P<indent>\s*)if (?P<cond>.*\bself\.max_num_\w+_reqs\b.*):\s*$")
_ASSIGNMENT = re.compile(r"^\s*(?P<names>[\w, ]+?)\s*=[^=]")
# What may differ between two series whose text is "the same": blob ids and line numbers.
_LOCATION = re.compile(r"^(index \S+|@@ -\d+(,\d+)? \+\d+(,\d+)? @@)", re.M)


class SeamError(RuntimeError):
    pass


def add_seam(source: str, method_head: str) -> tuple[str, str]:
    """``source`` with the seam (the method starts with ``method_head``: its signature and
    docstring); also the commit-message note about the condition (may be '')."""
    lines = source.splitlines(keepends=True)
    schedule_at = next(
        (i for i, ln in enumerate(lines) if ln.startswith("    def schedule(")), None
    )
    if schedule_at is None:
        raise SeamError("no Scheduler.schedule()")
    end_of_schedule = next(
        (i for i in range(schedule_at + 1, len(lines)) if lines[i].startswith("    def ")),
        len(lines),
    )
    # In every release so far the only slot check that breaks a loop in schedule() is the one in
    # the WAITING loop (the RUNNING loop preempts instead); two would be ambiguous.
    checks = [
        i
        for i in range(schedule_at, end_of_schedule - 1)
        if _SLOT_CHECK.match(lines[i]) and lines[i + 1].strip() == "break"
    ]
    if len(checks) != 1:
        raise SeamError(f"expected one 'if ...self.max_num_*_reqs: break' in schedule(), {checks}")
    check_at = checks[0]
    match = _SLOT_CHECK.match(lines[check_at])
    assert match is not None
    indent, cond = match.group("indent"), match.group("cond")
    # The comment and assignment lines directly above the check compute its inputs.
    first = check_at
    while first > 0:
        above = lines[first - 1]
        same_block = above.startswith(indent) and not above[len(indent)].isspace()
        if same_block and (above.strip().startswith("#") or _ASSIGNMENT.match(above)):
            first -= 1
        else:
            break
    pre = lines[first:check_at]
    later = "".join(lines[check_at + 2 : end_of_schedule])
    for line in pre:
        if assignment := _ASSIGNMENT.match(line):
            for name in assignment.group("names").split(","):
                if re.search(rf"\b{re.escape(name.strip())}\b", later):
                    raise SeamError(f"{name.strip()!r} is read after the check; cannot move it")
    note = ""
    if re.search(r"\s==\s*self\.max_num_running_reqs", cond):
        cond = re.sub(r"\s==\s", " >= ", cond)
        note = EQ_NOTE
    moved = "".join("        " + ln[len(indent) :] if ln.strip() else ln for ln in pre)
    method = f"{method_head}{moved}        return {cond}\n\n"
    call = f"{indent}if self.{SEAM_METHOD}():\n"
    new_lines = (
        lines[:schedule_at] + [method] + lines[schedule_at:first] + [call] + lines[check_at + 1 :]
    )
    return "".join(new_lines), note


class Authored(NamedTuple):
    message: str
    test: str  # the unit test file
    method_head: str  # the seam method's signature and docstring


def authored() -> Authored:
    """The text written by hand, as the newest stored series has it.

    That series is where it is written: edit its message, its test lines or the method's docstring
    there, then run this script on every release (the other series, and the newest's diffstat,
    line counts and blob ids, follow).
    """
    newest = all_series()[-1]
    patch = newest.patches[0]
    added = [ln[1:] for ln in patch.read_text(encoding="utf-8").splitlines(True) if ln[0] == "+"]
    start = added.index(f"    def {SEAM_METHOD}(self) -> bool:\n")
    head = "".join(added[start : added.index('        """\n', start) + 1])
    return Authored(commit_message(patch), seam_test_text(newest), head)


def release_message(message: str, note: str) -> str:
    """``message`` with this release's note on the condition after its no-change sentence."""
    if note and NOTE_AFTER not in message:
        raise SeamError(f"the newest series' message lost {NOTE_AFTER!r}; the note goes after it")
    return message.replace(NOTE_AFTER, NOTE_AFTER + note, 1)


def unit_test(seamed_source: str, authored_test: str) -> str:
    """The test file for this release: the authored one, less the paused-streaming and the
    max_num_active_seqs cases where the default does not read them. A case is one top-level
    block (blocks are separated by two blank lines) and is known by a word only it uses."""
    _, method, _ = split_at_seam_method(seamed_source)
    dropped = [case for case, read in RELEASE_CASES.items() if read not in method]
    blocks = authored_test.rstrip("\n").split("\n\n\n")
    text = "\n\n\n".join(b for b in blocks if not any(case in b for case in dropped)) + "\n"
    if STREAMING_CASE in dropped:
        text = text.replace("from vllm.v1.request import RequestStatus\n", "")
    return text


def series_text(source: str) -> tuple[str, dict[str, str]]:
    """The patch for a release whose ``scheduler.py`` is ``source`` (message, then the diff), and
    the files it gives (repository path -> text)."""
    hand = authored()
    seamed, note = add_seam(source, hand.method_head)
    with tempfile.TemporaryDirectory(prefix="vllm-seam-series-") as tmp:
        repo = Path(tmp)
        git(repo, "init", "-q")
        target = repo / SCHEDULER_PATH
        target.parent.mkdir(parents=True)
        target.write_text(source, encoding="utf-8")
        git(repo, "add", "-A")
        before = git(repo, "write-tree").stdout.strip()  # no commit, so no identity is needed
        target.write_text(seamed, encoding="utf-8")
        test = repo / SEAM_TEST_PATH
        test.parent.mkdir(parents=True)
        files = {SCHEDULER_PATH: seamed, SEAM_TEST_PATH: unit_test(seamed, hand.test)}
        test.write_text(files[SEAM_TEST_PATH], encoding="utf-8")
        git(repo, "add", "-A")
        diff = git(repo, "diff", "--cached", "--patch-with-stat", "--full-index", before).stdout
    return release_message(hand.message, note) + "---\n" + diff, files


def serves(series: Series, source: str, generated: tuple[str, dict[str, str]]) -> bool:
    """Whether ``series`` gives, from ``source``, byte for byte what the ``generated`` patch (its
    text and its files, from ``series_text``) gives."""
    text, files = generated
    if _LOCATION.sub("", series.patches[0].read_text(encoding="utf-8")) != _LOCATION.sub("", text):
        return False
    try:
        return apply_series({SCHEDULER_PATH: source}, series) == files
    except PatchError:
        return False


def neighbours(version: str) -> tuple[Series | None, Series | None]:
    """The nearest stored series older than ``version`` and the nearest newer one."""
    stored = [s for s in all_series() if s.ref != f"v{version}"]
    older = [s for s in stored if s.version < Version(version)]
    newer = [s for s in stored if s not in older]
    return (older[-1] if older else None), (newer[0] if newer else None)


def store_series(version: str) -> str:
    """Write (or drop) the release's series; returns what was done, in one line."""
    source = wheel_scheduler_source(wheel_for(version))
    generated = series_text(source)
    older, newer = neighbours(version)
    directory = PATCH_ROOT / f"v{version}"
    if newer is not None and serves(newer, source, generated):
        if directory.exists():
            shutil.rmtree(directory)
        return f"v{version}: served by {newer.ref} (same text; not stored)"
    directory.mkdir(exist_ok=True)
    for old in directory.glob("*.patch"):
        old.unlink()
    (directory / PATCH_NAME).write_text(generated[0], encoding="utf-8")
    done = f"v{version}: wrote {directory.relative_to(PATCH_ROOT.parent)}/{PATCH_NAME}"
    if older is not None:
        older_version = older.ref.removeprefix("v")
        older_source = wheel_scheduler_source(wheel_for(older_version))
        written = Series(f"v{version}", directory, (directory / PATCH_NAME,))
        if serves(written, older_source, series_text(older_source)):
            shutil.rmtree(older.directory)
            done += f"; removed {older.ref} (now served by v{version})"
    return done


def check_series(version: str, source: str) -> str | None:
    """None if the stored series that serves ``version`` is what the generator gives; else why."""
    generated = series_text(source)
    own = PATCH_ROOT / f"v{version}" / PATCH_NAME
    if own.exists():
        return None if own.read_text(encoding="utf-8") == generated[0] else f"{own} differs"
    _, newer = neighbours(version)
    if newer is None or not serves(newer, source, generated):
        return f"no stored series gives v{version}'s patch (run make_series.py {version})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    failed = False
    # Newest first: whether a release is stored depends on the newer series.
    for version in sorted(args.versions, key=Version, reverse=True):
        try:
            if not args.check:
                print(store_series(version))
                continue
            source = wheel_scheduler_source(wheel_for(version))
            problem = check_series(version, source)
            served = serving_series(version)
            verdict = f"{served.ref if served else '-'} regenerated byte for byte"
            print(f"v{version}: {problem or verdict}")
            failed |= problem is not None
        except SeamError as exc:
            print(f"v{version}: {exc}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
