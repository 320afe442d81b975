"""Regenerate (or check) the seam series for vLLM releases.

    python upstream_patch/make_series.py 0.24.0 0.25.0 ...          # wheels from /tmp/wheels or pip
    python upstream_patch/make_series.py --check 0.24.0 0.25.0 ...

For each version: take ``vllm/v1/core/sched/scheduler.py`` from that release's wheel and
``tests/v1/core/test_scheduler.py`` and ``utils.py`` from its sdist (``seam_patch.release_files``),
add the seam and the unit tests (below), and write the commit message followed by the diff (``git
diff --patch-with-stat --full-index``) to ``upstream_patch/v<version>/seam.patch``. The message,
the method's docstring and the test cases are written once, in the newest stored series
(``authored``). No author, date or ``Signed-off-by`` is written: ``apply.py git`` commits with the
submitter's own git identity, and the submitter signs off. Regenerating an unchanged release
reproduces the same bytes.

A release's series is stored only where it differs: if the nearest newer stored series applies to
this release's files and gives byte for byte what the generator gives, that series serves this
release too and no directory is written (and a stored older series that the new one now covers is
removed). ``--check`` regenerates each version and compares it, byte for byte, with the stored
series that serves it.

The seam is the call and its default only (no policy in core), added mechanically, which is what
lets one generator follow the WAITING loop across releases. In ``scheduler.py``:

- a class docstring for ``Scheduler`` (it has none) naming the method as an override point;
- the method (signature, docstring, ``return False``) above ``schedule()``;
- right after the WAITING loop's request-slot check (the one ``if <cond>: break`` whose condition
  reads ``self.max_num_*_reqs``: ``max_num_running_reqs`` up to 0.30, ``max_num_active_reqs``
  from 0.31), the call, in one of two forms (``seam_form``). The slot check itself stays inline
  and unchanged, so an override can only admit less. Where the loop takes its queue before that
  check and drains ``self.kv_holding_waiting`` first (0.31+), the call guards fresh requests only:
  ``if request_queue is self.waiting and self._should_stop_admitting_waiting(): break``, so
  requests holding KV blocks (finished async loads) are still scheduled under a hold, as under
  ``PAUSED_NEW``. Where the loop has one mixed queue (0.24-0.30: ``waiting`` and
  ``skipped_waiting``, taken after the check), ``if self._should_stop_admitting_waiting(): break``
  ends the loop, KV-holders included, which is what ``PAUSED_NEW`` blocks there too.

Each form has its own message, docstrings and tests, written once in the newest stored series of
that form (``authored``). The tests go right after vLLM's throttle tests
(``test_throttle_capacity_bound_guard_admits``), not at the end of the file; where its
``create_scheduler()`` has no ``scheduler_cls`` parameter (before 0.31) the series adds it to
``tests/v1/core/utils.py`` as 0.31 did, and the message says so.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from packaging.version import Version

from balance_testbed.seam_patch import (
    PATCH_ROOT,
    SCHEDULER_PATH,
    SEAM_METHOD,
    SEAM_TEST_PATH,
    TEST_UTILS_PATH,
    PatchError,
    Series,
    added_lines,
    all_series,
    apply_series,
    commit_message,
    git,
    release_files,
    serving_series,
)
from vllm_balance.slot_check import holds_fresh_requests_only, slot_checks

PATCH_NAME = "seam.patch"
# The sentence of the authored message that a release's note follows.
NOTE_AFTER = "No behaviour change."
SCHEDULER_CLS_NOTE = """

Before 0.31, create_scheduler() in tests/v1/core/utils.py takes no
scheduler_cls; this series adds it, as 0.31 did, for the new tests."""
SCHEDULER_CLASS = "class Scheduler(SchedulerInterface):\n"
# The two forms of the call; a stored series' form is read from its call line.
FRESH, LOOP = "fresh", "loop"
FRESH_TEST = "request_queue is self.waiting"
CALL = f"self.{SEAM_METHOD}()"
# vLLM's last throttle test, in every release: the seam's tests go right after it.
TESTS_AFTER = "test_throttle_capacity_bound_guard_admits"
LINE_LENGTH = 88  # vLLM's ruff line length

_FACTORY_END = re.compile(r"^\) -> .*:\s*$")
_FACTORY_CLASS = re.compile(r"^(?P<indent>\s+)scheduler_cls = .*\n", re.M)
# What may differ between two series whose text is "the same": blob ids and line numbers.
_LOCATION = re.compile(r"^(index \S+|@@ -\d+(,\d+)? \+\d+(,\d+)? @@)", re.M)


class SeamError(RuntimeError):
    pass


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def seam_form(loop: ast.While, check: ast.If) -> str:
    """``FRESH`` where a hold can stop fresh requests only (0.31+), else ``LOOP``; the same test
    as the Phase 2A derivation's (``vllm_balance.slot_check.holds_fresh_requests_only``)."""
    return FRESH if holds_fresh_requests_only(loop, check) else LOOP


def call_lines(form: str, indent: str) -> str:
    """The call and its ``break``, formatted as vLLM's ruff would."""
    cond = f"{FRESH_TEST} and {CALL}" if form == FRESH else CALL
    one_line = f"{indent}if {cond}:\n"
    if len(one_line) - 1 <= LINE_LENGTH:
        return f"{one_line}{indent}    break\n"
    parts = cond.split(" and ")
    inner = "".join(f"{indent}    {'and ' if i else ''}{part}\n" for i, part in enumerate(parts))
    return f"{indent}if (\n{inner}{indent}):\n{indent}    break\n"


def waiting_slot_check(source: str) -> tuple[list[str], int, int, ast.While, ast.If]:
    """``source``'s lines, the 0-based lines of ``def schedule(`` and of the slot check, the
    WAITING loop and the check itself."""
    lines = source.splitlines(keepends=True)
    schedule_at = next(
        (i for i, ln in enumerate(lines) if ln.startswith("    def schedule(")), None
    )
    if schedule_at is None:
        raise SeamError("no Scheduler.schedule()")
    # The same anchor as the Phase 2A derivation's (vllm_balance.slot_check).
    schedule = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.FunctionDef) and n.lineno == schedule_at + 1
    )
    checks = slot_checks(schedule)
    if len(checks) != 1:
        found = [check.lineno for _, check in checks]
        raise SeamError(f"expected one 'if ...self.max_num_*_reqs: break' in a loop, {found}")
    loop, check = checks[0]
    if check.test.end_lineno != check.lineno or check.body[0].lineno != check.lineno + 1:
        raise SeamError(f"the slot check is not 'if <one line>:' then 'break': {check.lineno}")
    return lines, schedule_at, check.lineno - 1, loop, check


def source_form(source: str) -> str:
    """The seam's form for ``scheduler.py`` text ``source`` (``seam_form``)."""
    *_, loop, check = waiting_slot_check(source)
    return seam_form(loop, check)


def add_seam(source: str, hand: Authored) -> str:
    """``scheduler.py`` text ``source`` with the seam, in the form its WAITING loop takes, with
    that form's authored class docstring and method head (signature and docstring)."""
    lines, schedule_at, check_at, loop, check = waiting_slot_check(source)
    form = seam_form(loop, check)
    if form != hand.form:
        raise SeamError(f"this scheduler.py takes the {form!r} form, the text is {hand.form!r}")
    class_at = next((i for i, ln in enumerate(lines) if ln == SCHEDULER_CLASS), None)
    if class_at is None or lines[class_at + 1].lstrip().startswith('"""'):
        raise SeamError(f"expected {SCHEDULER_CLASS.strip()!r} without a docstring")
    indent = lines[check_at][: _indent(lines[check_at])]
    method = f"{hand.method_head}        return False\n\n"
    new_lines = (
        lines[: class_at + 1]
        + [hand.class_doc, "\n"]  # ruff: a blank line after a class docstring
        + lines[class_at + 1 : schedule_at]
        + [method]
        + lines[schedule_at : check_at + 2]
        + [call_lines(form, indent)]
        + lines[check_at + 2 :]
    )
    return "".join(new_lines)


def add_tests(tests_source: str, cases: str) -> str:
    """vLLM's ``test_scheduler.py`` text with ``cases`` right after its last throttle test."""
    fn = next(
        (
            n
            for n in ast.parse(tests_source).body
            if isinstance(n, ast.FunctionDef) and n.name == TESTS_AFTER
        ),
        None,
    )
    if fn is None or fn.end_lineno is None:
        raise SeamError(f"{SEAM_TEST_PATH} has no {TESTS_AFTER}()")
    lines = tests_source.splitlines(keepends=True)
    at = fn.end_lineno + 2  # after the two blank lines that follow it
    if [ln.strip() for ln in lines[fn.end_lineno : at]] != ["", ""] or not lines[at:]:
        raise SeamError(f"{TESTS_AFTER}() is not followed by two blank lines and more code")
    return "".join(lines[:at]) + cases + "\n\n" + "".join(lines[at:])


def add_scheduler_cls(utils: str) -> str:
    """``tests/v1/core/utils.py`` text whose ``create_scheduler()`` takes ``scheduler_cls``
    (None: the class it chose before), as 0.31 added it; unchanged where it has it."""
    head, found, rest = utils.partition("\ndef create_scheduler(\n")
    if not found:
        raise SeamError(f"{TEST_UTILS_PATH} has no create_scheduler()")
    body = rest.split("\ndef ", 1)[0]
    if "scheduler_cls" in body.split("\n) -> ", 1)[0]:
        return utils
    lines = body.splitlines(keepends=True)
    end = next((i for i, ln in enumerate(lines) if _FACTORY_END.match(ln)), None)
    if end is None:
        raise SeamError("create_scheduler()'s signature does not end in ') -> ...:'")
    lines.insert(end, "    scheduler_cls: type[Scheduler] | None = None,\n")
    new_body, count = _FACTORY_CLASS.subn(
        lambda m: f"{m['indent']}if scheduler_cls is None:\n    {m[0]}", "".join(lines)
    )
    if count != 1:
        raise SeamError(f"create_scheduler() assigns scheduler_cls {count} times")
    return head + found + new_body + rest[len(body) :]


class Authored(NamedTuple):
    form: str  # FRESH or LOOP: the scheduler.py texts it is for
    message: str
    tests: str  # the cases inserted after vLLM's throttle tests
    method_head: str  # the seam method's signature and docstring
    class_doc: str  # Scheduler's class docstring


def _docstring_at(lines: list[str], start: int) -> str:
    """The docstring that opens at ``lines[start]`` (a triple-quoted block), as text."""
    if lines[start].count('"""') == 2:
        return lines[start]
    end = next(i for i in range(start + 1, len(lines)) if lines[i].rstrip().endswith('"""'))
    return "".join(lines[start : end + 1])


def series_form(series: Series) -> str:
    """A stored series' form, read from its call line."""
    return FRESH if any(FRESH_TEST in ln for ln in added_lines(series, SCHEDULER_PATH)) else LOOP


def authored(form: str = FRESH) -> Authored:
    """The text written by hand for ``form``, as the newest stored series of that form has it.

    That series is where it is written: edit its message, its test lines or the docstrings there,
    then run this script on every release (the other series of that form, and the newest's
    diffstat, line counts and blob ids, follow).
    """
    of_form = [s for s in all_series() if series_form(s) == form]
    if not of_form:
        raise SeamError(f"no stored series of the {form!r} form to read its text from")
    newest = of_form[-1]
    added = added_lines(newest, SCHEDULER_PATH)
    start = added.index(f"    def {SEAM_METHOD}(self) -> bool:\n")
    head = "".join(added[start : added.index('        """\n', start) + 1])
    # Blank lines around the inserted cases are the file's layout, not the cases' text (git may
    # place them on either side of the block).
    tests = "".join(added_lines(newest, SEAM_TEST_PATH)).strip("\n") + "\n"
    # A release's own note (release_message) is not authored text.
    message = commit_message(newest.patches[0]).replace(SCHEDULER_CLS_NOTE, "", 1)
    return Authored(form, message, tests, head, _docstring_at(added, 0))


def release_message(message: str, note: str) -> str:
    """``message`` with this release's note after its no-change sentence."""
    if note and NOTE_AFTER not in message:
        raise SeamError(f"the newest series' message lost {NOTE_AFTER!r}; the note goes after it")
    return message.replace(NOTE_AFTER, NOTE_AFTER + note, 1)


def series_text(base: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The patch for a release whose files are ``base`` (``release_files``: message, then the
    diff), and the files it gives (repository path -> text)."""
    hand = authored(source_form(base[SCHEDULER_PATH]))
    utils = add_scheduler_cls(base[TEST_UTILS_PATH])
    note = SCHEDULER_CLS_NOTE if utils != base[TEST_UTILS_PATH] else ""
    files = {
        SCHEDULER_PATH: add_seam(base[SCHEDULER_PATH], hand),
        SEAM_TEST_PATH: add_tests(base[SEAM_TEST_PATH], hand.tests),
        TEST_UTILS_PATH: utils,
    }
    with tempfile.TemporaryDirectory(prefix="vllm-seam-series-") as tmp:
        repo = Path(tmp)
        git(repo, "init", "-q")
        trees = []
        for texts in (base, files):
            for rel, text in texts.items():
                (repo / rel).parent.mkdir(parents=True, exist_ok=True)
                (repo / rel).write_text(text, encoding="utf-8")
            git(repo, "add", "-A")
            trees.append(git(repo, "write-tree").stdout.strip())  # no commit: no identity
        diff = git(repo, "diff", "--patch-with-stat", "--full-index", *trees).stdout
    return release_message(hand.message, note) + "---\n" + diff, files


def serves(series: Series, base: dict[str, str], generated: tuple[str, dict[str, str]]) -> bool:
    """Whether ``series`` gives, from the release files ``base``, byte for byte what the
    ``generated`` patch (its text and its files, from ``series_text``) gives."""
    text, files = generated
    if _LOCATION.sub("", series.patches[0].read_text(encoding="utf-8")) != _LOCATION.sub("", text):
        return False
    try:
        return apply_series(base, series) == files
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
    base = release_files(version)
    generated = series_text(base)
    older, newer = neighbours(version)
    directory = PATCH_ROOT / f"v{version}"
    if newer is not None and serves(newer, base, generated):
        if directory.exists():
            shutil.rmtree(directory)
        return f"v{version}: served by {newer.ref} (same text; not stored)"
    directory.mkdir(exist_ok=True)
    for old in directory.glob("*.patch"):
        old.unlink()
    (directory / PATCH_NAME).write_text(generated[0], encoding="utf-8")
    done = f"v{version}: wrote {directory.relative_to(PATCH_ROOT.parent)}/{PATCH_NAME}"
    if older is not None:
        older_base = release_files(older.ref.removeprefix("v"))
        written = Series(f"v{version}", directory, (directory / PATCH_NAME,))
        if serves(written, older_base, series_text(older_base)):
            shutil.rmtree(older.directory)
            done += f"; removed {older.ref} (now served by v{version})"
    return done


def check_series(version: str, scheduler_source: str | None = None) -> str | None:
    """None if the stored series that serves ``version`` is what the generator gives for that
    release (its wheel's ``scheduler.py``, or ``scheduler_source``); else why."""
    base = release_files(version, scheduler_source)
    generated = series_text(base)
    own = PATCH_ROOT / f"v{version}" / PATCH_NAME
    if own.exists():
        return None if own.read_text(encoding="utf-8") == generated[0] else f"{own} differs"
    _, newer = neighbours(version)
    if newer is None or not serves(newer, base, generated):
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
            problem = check_series(version)
            served = serving_series(version)
            verdict = f"{served.ref if served else '-'} regenerated byte for byte"
            print(f"v{version}: {problem or verdict}")
            failed |= problem is not None
        except (SeamError, PatchError) as exc:
            print(f"v{version}: {exc}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
