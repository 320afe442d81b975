"""upstream_patch/apply.py: both modes apply the whole series or nothing, and are idempotent.

``git`` mode runs on a scratch git repository holding the installed vLLM's scheduler.py at
upstream's path (the unpatched text: reverted first if the seam sessions patched the install) and
the release's test files the series adds to (from its sdist), so ``git apply`` meets the same
blobs it meets on a real vLLM checkout; the commit's author is the
identity in the (test's) git configuration, never one the series invents. ``installed`` mode
writes to a copy of the installed tree (``--root``); against the real install it runs only as
``--check``, because the shared test venvs must not change (the nox seam sessions apply it for
real, and tests/test_seam_neutrality.py checks that they did).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from balance_testbed.seam_patch import (
    SCHEDULER_PATH,
    SEAM_METHOD,
    SEAM_TEST_PATH,
    installed_version,
    installed_vllm_root,
    match_series,
    release_files,
    scheduler_text,
    seam_stops_before_installed,
    serving_series,
)

ROOT = Path(__file__).resolve().parent.parent
APPLY = ROOT / "upstream_patch" / "apply.py"

# The submitter's git configuration, as a test stands it in: apply.py must use it, not invent one.
SUBMITTER = "Test Submitter <submitter@example.com>"
USER_CONFIG = "[user]\n\tname = Test Submitter\n\temail = submitter@example.com\n"


@pytest.fixture(autouse=True)
def git_env(tmp_path, monkeypatch):
    """Git sees only the test's configuration: no system or user-level settings, no identity from
    the environment."""
    config = tmp_path / "gitconfig"
    config.write_text(USER_CONFIG)
    for name in ("AUTHOR", "COMMITTER"):
        monkeypatch.delenv(f"GIT_{name}_NAME", raising=False)
        monkeypatch.delenv(f"GIT_{name}_EMAIL", raising=False)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    return config


def run_apply(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(APPLY), *args], capture_output=True, text=True, timeout=120
    )


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def assert_one_line_error(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("apply.py: error: "), result.stderr


@pytest.fixture(scope="module")
def installed_source() -> str:
    return (installed_vllm_root() / SCHEDULER_PATH).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def match(installed_source):
    if reason := seam_stops_before_installed():
        pytest.skip(reason)
    return match_series(installed_source, installed_version() or None)


@pytest.fixture(scope="module")
def replaced_line(match) -> str:
    """A line of scheduler.py the series needs as it is: the slot check its call follows (a
    context line of its scheduler diff; the series removes nothing)."""
    text = match.series.patches[0].read_text(encoding="utf-8")
    scheduler_part = text.split(f"+++ b/{SCHEDULER_PATH}\n", 1)[1].split("\ndiff --git ", 1)[0]
    (slot_check,) = [
        ln[1:] for ln in scheduler_part.splitlines() if ln.startswith(" ") and "self.max_num_" in ln
    ]
    return slot_check


@pytest.fixture(scope="module")
def unpatched_source(installed_source, match) -> str:
    if match.already_seamed:
        return scheduler_text(installed_source, match.series, reverse=True)
    return installed_source


@pytest.fixture(scope="module")
def patched_source(unpatched_source, match) -> str:
    return scheduler_text(unpatched_source, match.series)


def test_series_for_the_installed_vllm_is_the_one_that_serves_its_version(match):
    assert match.series == serving_series(installed_version())


# ------------------------------------------------------------------------------ installed mode


def test_installed_check_is_a_dry_run_on_the_real_install(match):
    target = installed_vllm_root() / SCHEDULER_PATH
    before = hashlib.sha256(target.read_bytes()).hexdigest()

    result = run_apply("installed", "--check")

    assert result.returncode == 0, result.stderr
    expected = "already applied; nothing to do" if match.already_seamed else "applies cleanly"
    assert expected in result.stdout
    assert hashlib.sha256(target.read_bytes()).hexdigest() == before


@pytest.fixture
def vllm_copy(tmp_path, unpatched_source) -> Path:
    target = tmp_path / SCHEDULER_PATH
    target.parent.mkdir(parents=True)
    target.write_text(unpatched_source, encoding="utf-8")
    return tmp_path


def test_installed_applies_the_non_test_part_then_says_it_is_done(vllm_copy, patched_source):
    target = vllm_copy / SCHEDULER_PATH

    first = run_apply("installed", "--root", str(vllm_copy))
    second = run_apply("installed", "--root", str(vllm_copy))

    assert first.returncode == 0 and "applied (vllm/v1/core/sched/scheduler.py)" in first.stdout
    assert target.read_text(encoding="utf-8") == patched_source
    assert second.returncode == 0 and "already applied; nothing to do" in second.stdout
    assert target.read_text(encoding="utf-8") == patched_source
    assert not (vllm_copy / "tests").exists()  # the series' test file is for vLLM's tree only


def test_installed_revert_restores_the_exact_original(vllm_copy, unpatched_source):
    assert run_apply("installed", "--root", str(vllm_copy)).returncode == 0
    result = run_apply("installed", "--root", str(vllm_copy), "--revert")
    assert result.returncode == 0, result.stderr
    assert (vllm_copy / SCHEDULER_PATH).read_text(encoding="utf-8") == unpatched_source


def test_installed_refuses_a_scheduler_the_series_does_not_fit_and_writes_nothing(
    vllm_copy, replaced_line
):
    target = vllm_copy / SCHEDULER_PATH
    # A fork that changed a line the series needs: no series may apply, at any offset.
    text = target.read_text(encoding="utf-8")
    assert text.count(replaced_line + "\n") == 1
    mangled = text.replace(replaced_line + "\n", replaced_line + "  # fork\n")
    target.write_text(mangled, encoding="utf-8")

    result = run_apply("installed", "--root", str(vllm_copy))

    assert_one_line_error(result)
    assert "no series" in result.stderr
    assert target.read_text(encoding="utf-8") == mangled


# ------------------------------------------------------------------------------------ git mode


@pytest.fixture
def vllm_repo(tmp_path, unpatched_source) -> Path:
    """A git repository with the release's scheduler.py and scheduler tests at upstream's paths,
    tagged as the installed release (which may have no series of its own: the newer one serves
    it)."""
    repo = tmp_path / "vllm"
    for path, text in release_files(installed_version(), unpatched_source).items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text, encoding="utf-8")
    git(tmp_path, "init", "-q", "-b", "main", str(repo))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "release")
    git(repo, "tag", f"v{installed_version()}")
    return repo


def test_git_commits_the_series_as_the_configured_user_without_sign_off(
    vllm_repo, match, patched_source
):
    ref = f"v{installed_version()}"

    result = run_apply("git", str(vllm_repo), "--ref", ref)

    assert result.returncode == 0, result.stderr
    branch = f"admission-seam-{match.series.ref}"
    assert git(vllm_repo, "rev-parse", "--abbrev-ref", "HEAD") == branch
    assert git(vllm_repo, "rev-parse", f"{branch}~1") == git(vllm_repo, "rev-parse", ref)
    assert git(vllm_repo, "log", "-1", "--format=%an <%ae>|%cn <%ce>") == f"{SUBMITTER}|{SUBMITTER}"
    assert git(vllm_repo, "log", "-1", "--format=%s").startswith("[Core] ")
    assert "Signed-off-by" not in git(vllm_repo, "log", "-1", "--format=%B")
    assert (vllm_repo / SCHEDULER_PATH).read_text(encoding="utf-8") == patched_source
    test_file = vllm_repo / SEAM_TEST_PATH
    assert f"def {SEAM_METHOD}(self)" in test_file.read_text(encoding="utf-8")
    assert git(vllm_repo, "status", "--porcelain") == ""


def test_git_signoff_is_the_configured_user(vllm_repo):
    result = run_apply("git", str(vllm_repo), "--ref", f"v{installed_version()}", "--signoff")

    assert result.returncode == 0, result.stderr
    trailers = git(vllm_repo, "log", "-1", "--format=%(trailers:key=Signed-off-by,valueonly)")
    assert trailers == SUBMITTER


def test_git_without_an_identity_refuses_and_leaves_no_branch(vllm_repo, git_env):
    # A user with no name/email configured: git refuses to commit; nothing is made up instead.
    git_env.write_text("[user]\n\tuseConfigOnly = true\n")
    head = git(vllm_repo, "rev-parse", "HEAD")

    result = run_apply("git", str(vllm_repo), "--ref", f"v{installed_version()}")

    assert_one_line_error(result)
    assert "branch removed" in result.stderr
    assert git(vllm_repo, "rev-parse", "HEAD") == head
    assert git(vllm_repo, "rev-parse", "--abbrev-ref", "HEAD") == "main"
    assert git(vllm_repo, "branch", "--list", "admission-seam-*") == ""
    assert git(vllm_repo, "status", "--porcelain") == ""


def test_git_again_says_the_branch_is_built(vllm_repo):
    ref = f"v{installed_version()}"
    assert run_apply("git", str(vllm_repo), "--ref", ref).returncode == 0
    git(vllm_repo, "checkout", "-q", "main")

    result = run_apply("git", str(vllm_repo), "--ref", ref)

    assert result.returncode == 0
    assert "already carries the seam; nothing to do" in result.stdout


def test_git_never_half_applies_a_series_that_does_not_fit(vllm_repo, replaced_line):
    target = vllm_repo / SCHEDULER_PATH
    text = target.read_text(encoding="utf-8")
    target.write_text(text.replace(replaced_line + "\n", replaced_line + "  # fork\n"))
    git(vllm_repo, "commit", "-q", "-am", "fork change")
    head = git(vllm_repo, "rev-parse", "HEAD")

    # HEAD is no version, so every series is tried on its scheduler.py.
    result = run_apply("git", str(vllm_repo), "--ref", "HEAD")

    assert_one_line_error(result)
    assert "HEAD: no series" in result.stderr
    assert git(vllm_repo, "rev-parse", "HEAD") == head
    assert git(vllm_repo, "rev-parse", "--abbrev-ref", "HEAD") == "main"
    assert git(vllm_repo, "branch", "--list", "admission-seam-*") == ""
    assert git(vllm_repo, "status", "--porcelain") == ""
    assert not (vllm_repo / ".git" / "rebase-apply").exists()
