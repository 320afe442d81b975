"""Regenerate (or check) the seam series for vLLM releases.

    python upstream_patch/make_series.py 0.24.0 0.25.0 ...          # wheels from /tmp/wheels or pip
    python upstream_patch/make_series.py --check 0.24.0 0.25.0 ...

For each version: take ``vllm/v1/core/sched/scheduler.py`` from that release's wheel, apply the
seam (below), add the unit test, and write the commit message followed by the diff (``git diff
--patch-with-stat --full-index``) to ``upstream_patch/v<version>/seam.patch``. No author, date or
``Signed-off-by`` is written: ``apply.py git`` commits with the submitter's own git identity, and
the submitter signs off. Regenerating an unchanged release reproduces the same bytes.

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
import subprocess
import sys
import tempfile
from pathlib import Path

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
    serving_series,
    split_at_seam_method,
    wheel_for,
    wheel_scheduler_source,
)

PATCH_NAME = "seam.patch"

MESSAGE = """\
[Core] Make the WAITING admission stop condition an overridable method

Scheduler.schedule() stops taking WAITING requests when the request slots
are full. Move that condition into Scheduler.{method}(),
which returns exactly what the inline check computed, and call it from the
same place in the loop. No behaviour change.{note}

A scheduler subclass can then hold back admission for a step by overriding
one method instead of copying schedule() (more than 700 lines, which go
stale with every release). The case at hand is data-parallel balance for MoE
models (RFC #29722): every DP rank stops admitting while any rank's batch is
full, e.g.

    class BalanceScheduler(AsyncScheduler):
        def {method}(self) -> bool:
            return super().{method}() or self.admission_frozen

The leading underscore keeps the method private: like Scheduler's other
`_` methods, it carries no stability promise to subclasses.

The new tests override the method on Scheduler and on AsyncScheduler.
"""

EQ_NOTE = """

The inline check was `==`; the method uses `>=`, which is equivalent here
because len(self.running) <= self.max_num_running_reqs always holds
(schedule() asserts it), and it keeps the default a stop if a subclass ever
lets running exceed the limit."""

METHOD = '''\
    def {method}(self) -> bool:
        """Whether schedule() stops taking WAITING requests for this step.

        Checked before each request the WAITING loop takes, so it holds back
        every waiting request: new ones, preempted ones, and ones that already
        hold KV blocks (e.g. after an async KV load). Running requests are
        scheduled either way. The default stops when the request slots are
        full. A subclass may override it to hold back admission (e.g. to
        balance load across data-parallel ranks); an override must not keep
        returning True while nothing is running, or the engine stalls.
        """
{pre}        return {cond}

'''

TEST_HEAD = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scheduler.{method}: the WAITING admission override point."""

import pytest

from vllm.v1.outputs import ModelRunnerOutput
{request_status}
from .utils import create_requests, create_scheduler

pytestmark = pytest.mark.cpu_test


def _step(scheduler):
    """schedule(), then one sampled token for each scheduled request."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    model_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={{req_id: i for i, req_id in enumerate(req_ids)}},
        sampled_token_ids=[[0] for _ in req_ids],
    )
    scheduler.update_from_output(output, model_output)
    return output


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_override_holds_back_waiting_requests(monkeypatch, async_scheduling):
    scheduler = create_scheduler(async_scheduling=async_scheduling)
    hold = True
    monkeypatch.setattr(scheduler, "{method}", lambda: hold)
    for request in create_requests(num_requests=3):
        scheduler.add_request(request)

    output = _step(scheduler)

    assert output.scheduled_new_reqs == []
    assert output.total_num_scheduled_tokens == 0
    assert len(scheduler.waiting) == 3
    assert not scheduler.running

    # Held back, not dropped: they are admitted once the override lets go.
    hold = False
    assert len(_step(scheduler).scheduled_new_reqs) == 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_override_is_checked_before_each_admission(monkeypatch, async_scheduling):
    scheduler = create_scheduler(async_scheduling=async_scheduling)
    default = scheduler.{method}
    # Admit only into an empty batch, on top of the default limit.
    monkeypatch.setattr(
        scheduler,
        "{method}",
        lambda: len(scheduler.running) >= 1 or default(),
    )
    requests = create_requests(num_requests=3)
    for request in requests:
        scheduler.add_request(request)

    output = _step(scheduler)
    assert [r.req_id for r in output.scheduled_new_reqs] == [requests[0].request_id]

    # Admission stays stopped; the running request is still scheduled.
    output = _step(scheduler)
    assert output.scheduled_new_reqs == []
    assert list(output.num_scheduled_tokens) == [requests[0].request_id]
'''

TEST_STREAMING = """

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_default_counts_paused_streaming_sessions(async_scheduling):
    scheduler = create_scheduler(max_num_seqs=2, async_scheduling=async_scheduling)
    (session,) = create_requests(num_requests=1, max_tokens=1, req_ids=["session"])
    session.resumable = True
    scheduler.add_request(session)
    _step(scheduler)  # its one output token ends the session's first turn
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert not scheduler.running
    for request in create_requests(num_requests=3):
        scheduler.add_request(request)

    output = scheduler.schedule()

    # The paused session keeps its slot: one of the two is left to admit.
    assert len(output.scheduled_new_reqs) == 1
    assert scheduler.{method}()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_override_holds_back_a_streaming_continuation(monkeypatch, async_scheduling):
    # The session keeps its KV blocks between turns: the override holds back
    # waiting requests that already hold KV, not only new ones.
    scheduler = create_scheduler(async_scheduling=async_scheduling)
    (session,) = create_requests(num_requests=1, max_tokens=1, req_ids=["session"])
    session.resumable = True
    scheduler.add_request(session)
    _step(scheduler)
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    hold = True
    monkeypatch.setattr(scheduler, "{method}", lambda: hold)
    (next_turn,) = create_requests(num_requests=1, max_tokens=1, req_ids=["session"])
    next_turn.resumable = True
    scheduler.add_request(next_turn)

    assert _step(scheduler).total_num_scheduled_tokens == 0
    assert session.num_computed_tokens > 0

    hold = False
    assert "session" in _step(scheduler).num_scheduled_tokens
"""

TEST_ACTIVE_SEQS = """

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_override_composes_with_max_num_active_seqs(monkeypatch, async_scheduling):
    # The default reads the active-request limit, not max_num_seqs: an
    # override that defers to it admits up to max_num_active_seqs.
    scheduler = create_scheduler(
        max_num_seqs=8, max_num_active_seqs=2, async_scheduling=async_scheduling
    )
    default = scheduler.{method}
    hold = True
    monkeypatch.setattr(
        scheduler, "{method}", lambda: hold or default()
    )
    for request in create_requests(num_requests=4):
        scheduler.add_request(request)

    assert _step(scheduler).scheduled_new_reqs == []

    hold = False
    assert len(_step(scheduler).scheduled_new_reqs) == 2
    assert len(scheduler.running) < scheduler.max_num_running_reqs
    assert default()
"""

_SLOT_CHECK = re.compile(r"^(?P<indent>\s*)if (?P<cond>.*\bself\.max_num_\w+_reqs\b.*):\s*$")
_ASSIGNMENT = re.compile(r"^\s*(?P<names>[\w, ]+?)\s*=[^=]")
# What may differ between two series whose text is "the same": blob ids and line numbers.
_LOCATION = re.compile(r"^(index \S+|@@ -\d+(,\d+)? \+\d+(,\d+)? @@)", re.M)


class SeamError(RuntimeError):
    pass


def add_seam(source: str) -> tuple[str, str]:
    """``source`` with the seam; also the commit-message note about the condition (may be '')."""
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
    method = METHOD.format(
        method=SEAM_METHOD,
        pre="".join("        " + ln[len(indent) :] if ln.strip() else ln for ln in pre),
        cond=cond,
    )
    call = f"{indent}if self.{SEAM_METHOD}():\n"
    new_lines = (
        lines[:schedule_at] + [method] + lines[schedule_at:first] + [call] + lines[check_at + 1 :]
    )
    return "".join(new_lines), note


def unit_test(seamed_source: str) -> str:
    """The test file for this release: the paused-streaming and the max_num_active_seqs cases
    only where the default reads them."""
    _, method, _ = split_at_seam_method(seamed_source)
    text = TEST_HEAD
    streaming = "num_waiting_for_streaming_input" in method
    if streaming:
        text += TEST_STREAMING
    if "max_num_active_reqs" in method:
        text += TEST_ACTIVE_SEQS
    request_status = "from vllm.v1.request import RequestStatus\n" if streaming else ""
    return text.format(method=SEAM_METHOD, request_status=request_status)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout


def series_text(source: str) -> str:
    """The patch for a release whose ``scheduler.py`` is ``source``: message, then the diff."""
    seamed, note = add_seam(source)
    with tempfile.TemporaryDirectory(prefix="vllm-seam-series-") as tmp:
        repo = Path(tmp)
        _git(repo, "init", "-q")
        target = repo / SCHEDULER_PATH
        target.parent.mkdir(parents=True)
        target.write_text(source, encoding="utf-8")
        _git(repo, "add", "-A")
        before = _git(repo, "write-tree").strip()  # no commit, so no identity is needed
        target.write_text(seamed, encoding="utf-8")
        test = repo / SEAM_TEST_PATH
        test.parent.mkdir(parents=True)
        test.write_text(unit_test(seamed), encoding="utf-8")
        _git(repo, "add", "-A")
        diff = _git(repo, "diff", "--cached", "--patch-with-stat", "--full-index", before)
    return MESSAGE.format(method=SEAM_METHOD, note=note) + "---\n" + diff


def _results(source: str, patches: list[Path] | tuple[Path, ...]) -> dict[str, str]:
    """The files a series produces from a release's ``scheduler.py`` (its test file included)."""
    return apply_series({SCHEDULER_PATH: source}, Series("v0", PATCH_ROOT, tuple(patches)))


def serves(series: Series, source: str, text: str) -> bool:
    """Whether ``series`` gives, from ``source``, byte for byte what patch ``text`` gives."""
    if _LOCATION.sub("", series.patches[0].read_text(encoding="utf-8")) != _LOCATION.sub("", text):
        return False
    with tempfile.TemporaryDirectory(prefix="vllm-seam-text-") as tmp:
        generated = Path(tmp) / PATCH_NAME
        generated.write_text(text, encoding="utf-8")
        wanted = _results(source, [generated])
    try:
        return _results(source, series.patches) == wanted
    except PatchError:
        return False


def neighbours(version: str) -> tuple[Series | None, Series | None]:
    """The nearest stored series older than ``version`` and the nearest newer one."""
    stored = [s for s in all_series() if s.ref != f"v{version}"]
    older = [s for s in stored if s.version < Series(f"v{version}", PATCH_ROOT, ()).version]
    newer = [s for s in stored if s not in older]
    return (older[-1] if older else None), (newer[0] if newer else None)


def store_series(version: str, wheel_dir: Path) -> str:
    """Write (or drop) the release's series; returns what was done, in one line."""
    source = wheel_scheduler_source(wheel_for(version, wheel_dir))
    text = series_text(source)
    older, newer = neighbours(version)
    directory = PATCH_ROOT / f"v{version}"
    if newer is not None and serves(newer, source, text):
        if directory.exists():
            shutil.rmtree(directory)
        return f"v{version}: served by {newer.ref} (same text; not stored)"
    directory.mkdir(exist_ok=True)
    for old in directory.glob("*.patch"):
        old.unlink()
    (directory / PATCH_NAME).write_text(text, encoding="utf-8")
    done = f"v{version}: wrote {directory.relative_to(PATCH_ROOT.parent)}/{PATCH_NAME}"
    if older is not None:
        older_version = older.ref.removeprefix("v")
        older_source = wheel_scheduler_source(wheel_for(older_version, wheel_dir))
        written = Series(f"v{version}", directory, (directory / PATCH_NAME,))
        if serves(written, older_source, series_text(older_source)):
            shutil.rmtree(older.directory)
            done += f"; removed {older.ref} (now served by v{version})"
    return done


def check_series(version: str, source: str) -> str | None:
    """None if the stored series that serves ``version`` is what the generator gives; else why."""
    text = series_text(source)
    own = PATCH_ROOT / f"v{version}" / PATCH_NAME
    if own.exists():
        return None if own.read_text(encoding="utf-8") == text else f"{own} differs"
    _, newer = neighbours(version)
    if newer is None or not serves(newer, source, text):
        return f"no stored series gives v{version}'s patch (run make_series.py {version})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    parser.add_argument("--wheel-dir", type=Path, default=Path("/tmp/wheels"))
    args = parser.parse_args(argv)
    args.wheel_dir.mkdir(parents=True, exist_ok=True)
    failed = False
    # Newest first: whether a release is stored depends on the newer series.
    for version in sorted(args.versions, key=Version, reverse=True):
        try:
            if not args.check:
                print(store_series(version, args.wheel_dir))
                continue
            source = wheel_scheduler_source(wheel_for(version, args.wheel_dir))
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
