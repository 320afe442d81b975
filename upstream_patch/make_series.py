"""Regenerate the seam series for vLLM releases, as real ``git format-patch`` output.

    python upstream_patch/make_series.py 0.24.0 0.25.0 ...   # wheels from /tmp/wheels or pip

For each version: take ``vllm/v1/core/sched/scheduler.py`` from that release's wheel, commit it to
a scratch git repository at upstream's path, apply the seam (below), add the upstream-style unit
test, commit with the message reviewers will read, and ``git format-patch`` the commit into
``upstream_patch/v<version>/``. Dates and identities are fixed, so regenerating an unchanged
release reproduces the same bytes.

The seam is an "extract method" refactoring done mechanically, which is what lets one generator
follow the WAITING loop across releases: the one ``if <cond>: break`` in ``schedule()`` whose
condition reads ``self.max_num_*_reqs`` (the check at the top of the WAITING loop, on the
request-slot limit: ``max_num_running_reqs`` up to 0.30, ``max_num_active_reqs`` from 0.31)
moves, together with the comment and assignment lines directly above it, into
``Scheduler._should_stop_admitting_waiting``; the loop calls the method. One normalization: an
``==`` slot check becomes ``>=`` (equivalent, since ``schedule()`` asserts
``len(self.running) <= max_num_running_reqs``; and the default stays a stop should a subclass
ever let running exceed the limit). The generator refuses a release where a moved assignment is
read later in ``schedule()``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seam_patch import PATCH_ROOT, SCHEDULER_PATH, SEAM_METHOD  # noqa: E402

TEST_PATH = "tests/v1/core/test_scheduler_admission_seam.py"
IDENTITY = "vllm-balance-scheduling developers"
# RFC 2606 reserved domain: the lead replaces it with the contributors' address before sending.
EMAIL = "developers@vllm-balance-scheduling.invalid"
# Fixed so that regenerating a series is byte-for-byte reproducible.
DATE = "2026-11-29T00:00:00+00:00"

SUBJECT = "[Core] Make the WAITING admission stop condition an overridable method"

BODY = """\
Admission policies that hold back new requests for a step (data-parallel
balance is the case at hand: SGLang's prefill delayer, TensorRT-LLM's
attention-DP balance, vllm-ascend's balance scheduling) have to change one
condition at the top of the WAITING loop in Scheduler.schedule(). Today the
only way to do that is to copy the whole method (~700 lines), and such
copies silently go stale with every release.

Extract that condition into Scheduler.{method}(), which
returns exactly this release's condition, and call it from the loop. A
subclass can now override the one decision, e.g.

    def {method}(self) -> bool:
        return self.admission_frozen or super().{method}()

No behaviour change: the default returns the same value the inline check
computed, at the same point of the loop.{note}

The test shows the default is unchanged and that a subclass override stops
admission while running requests keep being scheduled.

Signed-off-by: {identity} <{email}>
"""

EQ_NOTE = """

The inline check was `==`; the method uses `>=`, which is equivalent here
because len(self.running) <= self.max_num_running_reqs always holds
(schedule() asserts it), and it keeps the default a stop if a subclass ever
lets running exceed the limit."""

METHOD = '''\
    def {method}(self) -> bool:
        """Whether to stop admitting WAITING requests for the rest of this step.

        Override point for admission policies (e.g. balancing load across
        data-parallel ranks); schedule() checks it before each WAITING request.
        """
{pre}        return {cond}

'''

TEST_HEAD = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scheduler.{method}: the WAITING admission override point."""

import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput

from .utils import create_requests, create_scheduler

pytestmark = pytest.mark.cpu_test


def _create_scheduler_of(scheduler_cls: type[Scheduler], **kwargs) -> Scheduler:
    """Like create_scheduler(), but an instance of a Scheduler subclass."""
    template = create_scheduler(**kwargs)
    return scheduler_cls(
        vllm_config=template.vllm_config,
        kv_cache_config=template.kv_cache_config,
        structured_output_manager=template.structured_output_manager,
        block_size=template.block_size,
        log_stats=True,
    )


def _sample_one_token(scheduler: Scheduler, output) -> None:
    req_ids = list(output.num_scheduled_tokens)
    model_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={{req_id: i for i, req_id in enumerate(req_ids)}},
        sampled_token_ids=[[0] for _ in req_ids],
    )
    scheduler.update_from_output(output, model_output)


def test_default_stops_admission_at_max_num_seqs():
    scheduler = create_scheduler(max_num_seqs=2)
    for request in create_requests(num_requests=5):
        scheduler.add_request(request)
    assert not scheduler.{method}()

    output = scheduler.schedule()

    assert len(output.scheduled_new_reqs) == 2
    assert len(scheduler.running) == 2
    assert len(scheduler.waiting) == 3
    assert scheduler.{method}()


class NeverAdmit(Scheduler):
    def {method}(self) -> bool:
        return True


def test_override_stops_admission():
    scheduler = _create_scheduler_of(NeverAdmit)
    for request in create_requests(num_requests=3):
        scheduler.add_request(request)

    output = scheduler.schedule()

    assert output.scheduled_new_reqs == []
    assert output.total_num_scheduled_tokens == 0
    assert len(scheduler.waiting) == 3
    assert not scheduler.running


class AdmitOnlyIntoEmptyBatch(Scheduler):
    def {method}(self) -> bool:
        return len(self.running) >= 1 or super().{method}()


def test_override_is_checked_before_each_admission():
    scheduler = _create_scheduler_of(AdmitOnlyIntoEmptyBatch)
    requests = create_requests(num_requests=3)
    for request in requests:
        scheduler.add_request(request)

    output = scheduler.schedule()
    assert [r.req_id for r in output.scheduled_new_reqs] == [requests[0].request_id]
    _sample_one_token(scheduler, output)

    # Admission stays stopped; the running request is still scheduled.
    output = scheduler.schedule()
    assert output.scheduled_new_reqs == []
    assert list(output.num_scheduled_tokens) == [requests[0].request_id]
'''

TEST_STREAMING = """

def test_default_counts_paused_streaming_sessions():
    scheduler = create_scheduler(max_num_seqs=2)
    # A paused streaming session is not in `running` but holds a request slot.
    scheduler.num_waiting_for_streaming_input = 1
    for request in create_requests(num_requests=3):
        scheduler.add_request(request)

    output = scheduler.schedule()

    assert len(output.scheduled_new_reqs) == 1
    assert scheduler.{method}()
"""

_SLOT_CHECK = re.compile(r"^(?P<indent>\s*)if (?P<cond>.*\bself\.max_num_\w+_reqs\b.*):\s*$")
_ASSIGNMENT = re.compile(r"^\s*(?P<names>[\w, ]+?)\s*=[^=]")


class SeamError(RuntimeError):
    pass


def add_seam(source: str) -> tuple[str, str]:
    """``source`` with the seam; also the commit-body note about the condition (may be '')."""
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
    # In every release so far the only slot check that breaks a loop in schedule() is the one at
    # the top of the WAITING loop (the RUNNING loop preempts instead); two would be ambiguous.
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
    method_body = seamed_source.split(f"def {SEAM_METHOD}(", 1)[1].split("\n    def ", 1)[0]
    text = TEST_HEAD
    if "num_waiting_for_streaming_input" in method_body:
        text += TEST_STREAMING
    return text.format(method=SEAM_METHOD)


def wheel_for(version: str, wheel_dir: Path) -> Path:
    pattern = str(wheel_dir / f"vllm-{version}-*.whl")
    found = glob.glob(pattern)
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
             "-q", "-d", str(wheel_dir), f"vllm=={version}"],
            check=True,
        )  # fmt: skip
        found = glob.glob(pattern)
    return Path(found[0])


def git(repo: Path, *args: str, **kwargs) -> str:
    env = dict(os.environ)
    env.update(
        GIT_AUTHOR_NAME=IDENTITY,
        GIT_AUTHOR_EMAIL=EMAIL,
        GIT_COMMITTER_NAME=IDENTITY,
        GIT_COMMITTER_EMAIL=EMAIL,
        GIT_AUTHOR_DATE=DATE,
        GIT_COMMITTER_DATE=DATE,
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
    )
    return subprocess.run(
        ["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True, **kwargs
    ).stdout


def make_series(version: str, wheel_dir: Path, out_root: Path = PATCH_ROOT) -> Path:
    with zipfile.ZipFile(wheel_for(version, wheel_dir)) as wheel:
        source = wheel.read(SCHEDULER_PATH).decode("utf-8")
    seamed, note = add_seam(source)
    with tempfile.TemporaryDirectory(prefix="vllm-seam-series-") as tmp:
        repo = Path(tmp)
        git(repo, "init", "-q", "-b", "main")
        target = repo / SCHEDULER_PATH
        target.parent.mkdir(parents=True)
        target.write_text(source, encoding="utf-8")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"vLLM v{version}: {SCHEDULER_PATH} from the wheel")
        target.write_text(seamed, encoding="utf-8")
        test = repo / TEST_PATH
        test.parent.mkdir(parents=True)
        test.write_text(unit_test(seamed), encoding="utf-8")
        git(repo, "add", "-A")
        message = (
            SUBJECT
            + "\n\n"
            + BODY.format(method=SEAM_METHOD, note=note, identity=IDENTITY, email=EMAIL)
        )
        git(repo, "commit", "-q", "-F", "-", input=message)
        out = out_root / f"v{version}"
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*.patch"):
            old.unlink()
        git(
            repo,
            "format-patch",
            "-q",
            "--zero-commit",
            "--no-signature",
            "--full-index",
            "-o",
            str(out),
            "-1",
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line, apart from main() so tests/test_doc_commands.py can parse the docs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--wheel-dir", type=Path, default=Path("/tmp/wheels"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.wheel_dir.mkdir(parents=True, exist_ok=True)
    for version in args.versions:
        try:
            out = make_series(version, args.wheel_dir)
        except SeamError as exc:
            print(f"v{version}: {exc}", file=sys.stderr)
            return 1
        stat = textwrap.indent(
            subprocess.run(
                ["git", "apply", "--numstat", *map(str, sorted(out.glob("*.patch")))],
                capture_output=True, text=True, check=True,
            ).stdout,
            "    ",
        )  # fmt: skip
        print(f"v{version}: {out}\n{stat}", end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
