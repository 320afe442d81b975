"""upstream_patch/in-tree/: balance scheduling in vLLM itself, the alternative to the seam alone.

Each in-tree series is one commit written for exactly one release: alone where no seam series
serves that release (0.34.0 on, the seam's end), else stacked on that seam series (in-tree/
README.md). What is checked here is cheap: its form, and, where the installed vLLM is a release it
has (the main-verified pin's sessions), that it applies exactly to that release's files (the
installed ``vllm/`` files and the sdist's tests) and that ``apply.py git --in-tree`` builds the
branch. vLLM's own tests on it: ``nox -s vllm-own-tests -- --in-tree``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from balance_testbed.seam_patch import (
    IN_TREE_ROOT,
    SCHEDULER_PATH,
    SEAM_TEST_PATH,
    PatchError,
    all_series,
    apply_series,
    in_tree_stack,
    installed_version,
    installed_vllm_root,
    match_series,
    numstat,
    scheduler_text,
    serving_series,
    stack_files,
)

ROOT = Path(__file__).resolve().parent.parent
APPLY = ROOT / "upstream_patch" / "apply.py"
IN_TREE = all_series(IN_TREE_ROOT)
# What balance scheduling in vLLM touches: its config (and the config-time checks), the DP group's
# all-reduce beside sync_dp_state, the DP engine core, the scheduler's admission pause, vLLM's
# scheduler tests and a new test file for the two-rank sync.
ENGINE_TEST_PATH = "tests/v1/engine/test_balance_scheduling.py"
EXPECTED_PATHS = {
    "vllm/config/scheduler.py",
    "vllm/config/parallel.py",
    "vllm/config/vllm.py",
    "vllm/engine/arg_utils.py",
    SCHEDULER_PATH,
    "vllm/v1/engine/core.py",
    SEAM_TEST_PATH,
    ENGINE_TEST_PATH,
}


def test_every_in_tree_series_tops_its_releases_stack():
    """On the seam series serving its release where there is one; the newest stands alone (the
    seam series end at 0.33)."""
    assert IN_TREE, "no in-tree series"
    for series in IN_TREE:
        seam = serving_series(str(series.version))
        assert in_tree_stack(str(series.version)) == [*([seam] if seam else []), series]
    assert in_tree_stack(str(IN_TREE[-1].version)) == [IN_TREE[-1]]


@pytest.mark.parametrize("series", IN_TREE, ids=lambda s: s.ref)
def test_in_tree_series_is_a_message_then_a_diff_with_no_identity(series):
    for patch in series.patches:
        text = patch.read_text(encoding="utf-8")
        message, _ = text.split("\n---\n", 1)
        assert message.startswith("[Core] ")
        assert not re.search(r"^(From|Date|Signed-off-by|Author):", text, re.M)
        added = [ln[1:] for ln in text.splitlines() if ln.startswith("+")]
        assert max(len(line) for line in added) <= 88  # vLLM's ruff line-length


@pytest.mark.parametrize("series", IN_TREE, ids=lambda s: s.ref)
def test_in_tree_series_touches_what_balance_needs_and_keeps_vllms_tests(series):
    counts = numstat(series)
    assert set(counts) == EXPECTED_PATHS
    assert all(removed == 0 for path, (_, removed) in counts.items() if path.startswith("tests/"))


def _installed_stack() -> list:
    stack = in_tree_stack(installed_version())
    if not stack:
        pytest.skip(f"no in-tree series for the installed vLLM {installed_version()}")
    return stack


@pytest.fixture(scope="module")
def release_texts() -> dict[str, str]:
    """The installed release's files the stack changes, as it ships them (on the seam, the seam
    sessions patched the installed scheduler.py: reverted here)."""
    stack = _installed_stack()
    files = stack_files(installed_version(), stack, installed_vllm_root())
    if len(stack) > 1:
        match = match_series(files[SCHEDULER_PATH], installed_version())
        if match.already_seamed:
            files[SCHEDULER_PATH] = scheduler_text(files[SCHEDULER_PATH], match.series, True)
    return files


def test_in_tree_series_applies_exactly_to_the_installed_release(release_texts):
    patched = release_texts
    for series in _installed_stack():
        patched = apply_series(patched, series)

    # The hold is an admission pause: both reads of the pause in the waiting loop take it.
    assert patched[SCHEDULER_PATH].count("admission_pause == PauseState.UNPAUSED") == 2
    assert "self._sync_admission_hold()" in patched["vllm/v1/engine/core.py"]
    assert "def sync_dp_admission_hold(" in patched["vllm/config/parallel.py"]
    assert "balance_scheduling: bool = False" in patched["vllm/config/scheduler.py"]
    assert ENGINE_TEST_PATH in patched
    # Negative control: git apply takes no fuzz, so the result does not take it a second time.
    with pytest.raises(PatchError):
        apply_series(patched, _installed_stack()[-1])


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_apply_git_in_tree_commits_the_stack_once(tmp_path, monkeypatch, release_texts):
    config = tmp_path / "gitconfig"
    config.write_text("[user]\n\tname = Test Submitter\n\temail = submitter@example.com\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    repo = tmp_path / "vllm"
    for path, text in release_texts.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text, encoding="utf-8")
    git(tmp_path, "init", "-q", "-b", "main", str(repo))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "release")
    ref = f"v{installed_version()}"
    git(repo, "tag", ref)
    command = [sys.executable, str(APPLY), "git", str(repo), "--ref", ref, "--in-tree"]

    result = subprocess.run(command, capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    stack = _installed_stack()
    assert git(repo, "rev-parse", "--abbrev-ref", "HEAD") == f"balance-scheduling-{stack[-1].ref}"
    subjects = git(repo, "log", "--format=%s", f"{ref}..HEAD").splitlines()
    patches = [patch for series in stack for patch in series.patches]
    assert subjects == [p.read_text().split("\n", 1)[0] for p in patches[::-1]]
    assert git(repo, "status", "--porcelain") == ""
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr
