"""upstream_patch/in-tree/: balance scheduling in vLLM itself, the alternative to the seam alone.

Each in-tree series is one commit stacked on the seam series of its release (in-tree/README.md).
What is checked here is cheap: its form, and, where the installed vLLM is a release it has (the
main-verified pin's sessions), that it applies on top of the seam to that release's files (the
installed ``vllm/`` files, unseamed, and the sdist's tests) and that ``apply.py git --in-tree``
builds the two-commit branch. vLLM's own tests on it: ``nox -s vllm-own-tests -- --in-tree``.
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
    SEAM_METHOD,
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
    stack_files,
)

ROOT = Path(__file__).resolve().parent.parent
APPLY = ROOT / "upstream_patch" / "apply.py"
IN_TREE = all_series(IN_TREE_ROOT)
# What balance scheduling in vLLM touches: its config, the DP engine core, the scheduler (the gate
# on the seam) and its interface, and vLLM's scheduler tests.
EXPECTED_PATHS = {
    "vllm/config/scheduler.py",
    "vllm/engine/arg_utils.py",
    "vllm/v1/core/sched/interface.py",
    SCHEDULER_PATH,
    "vllm/v1/engine/core.py",
    SEAM_TEST_PATH,
}


def test_every_in_tree_series_is_stacked_on_a_seam_series():
    assert IN_TREE, "no in-tree series"
    for series in IN_TREE:
        stack = in_tree_stack(str(series.version))
        assert [s.directory for s in stack[1:]] == [series.directory]


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
    assert counts[SEAM_TEST_PATH][1] == 0, "vLLM's own tests stay as they are"


def _installed_stack() -> list:
    stack = in_tree_stack(installed_version())
    if not stack:
        pytest.skip(f"no in-tree series for the installed vLLM {installed_version()}")
    return stack


@pytest.fixture(scope="module")
def release_texts() -> dict[str, str]:
    """The installed release's files the stack changes, as it ships them (the seam sessions
    patched the installed scheduler.py: reverted here)."""
    stack = _installed_stack()
    files = stack_files(installed_version(), stack, installed_vllm_root())
    match = match_series(files[SCHEDULER_PATH], installed_version())
    if match.already_seamed:
        files[SCHEDULER_PATH] = scheduler_text(files[SCHEDULER_PATH], match.series, reverse=True)
    return files


def test_in_tree_series_applies_on_the_seam_to_the_installed_release(release_texts):
    seam, in_tree = _installed_stack()

    patched = apply_series(apply_series(release_texts, seam), in_tree)

    scheduler = patched[SCHEDULER_PATH]
    # The gate is the seam: the default now reads balance's own state.
    method = scheduler.split(f"def {SEAM_METHOD}(self) -> bool:", 1)[1].split("\n    def ", 1)[0]
    assert "return self._dp_rank_at_capacity()" in method
    assert "self._gather_running_counts()" in patched["vllm/v1/engine/core.py"]
    assert "balance_scheduling: bool = False" in patched["vllm/config/scheduler.py"]


def test_in_tree_series_does_not_apply_without_the_seam(release_texts):
    """Negative control: it is written against the seam's text, not the release's."""
    _, in_tree = _installed_stack()
    with pytest.raises(PatchError):
        apply_series(release_texts, in_tree)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_apply_git_in_tree_commits_the_seam_then_balance(tmp_path, monkeypatch, release_texts):
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

    result = subprocess.run(
        [sys.executable, str(APPLY), "git", str(repo), "--ref", ref, "--in-tree"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    seam, in_tree = _installed_stack()
    assert git(repo, "rev-parse", "--abbrev-ref", "HEAD") == f"balance-scheduling-{seam.ref}"
    subjects = git(repo, "log", "--format=%s", f"{ref}..HEAD").splitlines()
    expected = [p.read_text().split("\n", 1)[0] for p in (*in_tree.patches, *seam.patches)]
    assert subjects == expected
    assert git(repo, "status", "--porcelain") == ""
