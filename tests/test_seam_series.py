"""The patch series in upstream_patch/ are what a vLLM reviewer should receive.

Each series is real ``git format-patch`` output (mail headers, a message explaining why, a
Signed-off-by), touches only the scheduler and vLLM's tests/v1/core/, keeps the scheduler diff
small, and changes only what the seam needs. And vLLM's source appears in this repository only
inside those patches (and the PR description's diff).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "upstream_patch"))

from seam_patch import (  # noqa: E402
    SCHEDULER_PATH,
    SEAM_METHOD,
    all_series,
    installed_version,
    installed_vllm_root,
    match_series,
    parse_patch,
    scheduler_text,
)

SERIES = all_series()
# The pins name the refs production runs; a pin without its series is a gap to fill first.
sys.path.insert(0, str(ROOT / "tools"))
from pins import PIN_NAMES, read_pin  # noqa: E402


def test_every_pinned_release_has_a_series():
    refs = {s.ref for s in SERIES}
    for name in PIN_NAMES:
        pin = read_pin(name)
        if pin.version is None:
            pytest.skip(f"pin {name} is not an exact release: {pin.requirement}")
        assert f"v{pin.version}" in refs, f"no upstream_patch/v{pin.version}/ for pin {name}"


@pytest.mark.parametrize("series", SERIES, ids=lambda s: s.ref)
def test_series_is_format_patch_output_with_a_reason_and_sign_off(series):
    for patch in series.patches:
        text = patch.read_text(encoding="utf-8")
        assert re.match(r"From [0-9a-f]{40} Mon Sep 17 00:00:00 2001\n", text)
        assert re.search(r"^Subject: \[PATCH[^\]]*\] \[Core\] ", text, re.M)
        message = text.split("\n\n", 1)[1].split("\n---\n", 1)[0]
        assert "Signed-off-by: vllm-balance-scheduling developers <" in message
        assert len(message.split()) > 80, "the body must explain why, not only what"


@pytest.mark.parametrize("series", SERIES, ids=lambda s: s.ref)
def test_series_touches_only_the_scheduler_and_its_tests(series):
    paths = {d.path for d in series.file_diffs()}
    assert SCHEDULER_PATH in paths
    assert all(p == SCHEDULER_PATH or p.startswith("tests/v1/core/") for p in paths), paths


@pytest.mark.parametrize("series", SERIES, ids=lambda s: s.ref)
def test_scheduler_diff_is_the_method_and_its_call_only(series):
    (diff,) = series.scheduler_diffs()
    removed = [ln[1:].strip() for h in diff.hunks for ln in h.lines if ln[0] == "-"]
    added = [ln[1:].strip() for h in diff.hunks for ln in h.lines if ln[0] == "+"]
    # Removed: the inline check (and what computed its inputs); it all reappears in the method,
    # except the `if` itself, which becomes the method's `return`.
    assert removed[-1].startswith("if ") and "self.max_num_" in removed[-1]
    assert all(line in added for line in removed[:-1])
    assert f"if self.{SEAM_METHOD}():" in added
    assert f"def {SEAM_METHOD}(self) -> bool:" in added
    # The method returns the removed condition (0.24.0's `==` is written `>=`: see the body).
    condition = removed[-1].removeprefix("if ").removesuffix(":").replace(" == ", " >= ")
    assert f"return {condition}" in added
    assert diff.changed_lines <= 16, "the non-test diff must stay reviewable at a glance"


# Lines any user of vLLM writes too: imports, signatures we override, the licence header.
_SHARED_PREFIXES = ("from ", "import ", "def ", "class ", "# SPDX")


def _distinctive_lines(source: str) -> set[str]:
    # Long lines of logic are specific enough that finding one elsewhere means copied source.
    lines = (ln.strip() for ln in source.splitlines())
    return {ln for ln in lines if len(ln) >= 50 and not ln.startswith(_SHARED_PREFIXES)}


def test_no_vllm_source_outside_the_series():
    source = (installed_vllm_root() / SCHEDULER_PATH).read_text(encoding="utf-8")
    match = match_series(source, installed_version() or None)
    if match.already_seamed:  # our own lines are in there now; look for vLLM's only
        source = scheduler_text(source, match.series, reverse=True)
    vllm_lines = _distinctive_lines(source)
    series_dirs = {s.directory for s in SERIES}
    offenders = []
    for path in ROOT.rglob("*"):
        parts = set(path.relative_to(ROOT).parts)
        if not path.is_file() or path.suffix not in {".py", ".md", ".txt", ".toml", ".json"}:
            continue
        if parts & {".git", ".nox", "__pycache__", ".hypothesis"} or path.parent in series_dirs:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if path == ROOT / "docs" / "upstream-pr.md":
            # The PR description shows the diff; only its ```diff block may quote vLLM.
            text = re.sub(r"```diff\n.*?```", "", text, flags=re.S)
        hits = [ln for ln in _distinctive_lines(text) if ln in vllm_lines]
        if hits:
            offenders.append(f"{path.relative_to(ROOT)}: {hits[0]!r}")
    assert not offenders, offenders


def test_parse_patch_reads_the_diff_not_the_mail_around_it():
    (diff,) = [d for d in parse_patch(SERIES[0].patches[0].read_text()) if not d.is_test]
    assert diff.path == SCHEDULER_PATH and not diff.new_file and len(diff.hunks) == 2


def test_series_for_the_installed_release_is_what_make_series_generates():
    """The committed patch and the generator agree (a hand edit to either shows up here)."""
    from make_series import add_seam

    source = (installed_vllm_root() / SCHEDULER_PATH).read_text(encoding="utf-8")
    match = match_series(source, installed_version() or None)
    unpatched = (
        scheduler_text(source, match.series, reverse=True) if match.already_seamed else source
    )
    generated, _ = add_seam(unpatched)
    assert generated == scheduler_text(unpatched, match.series)


def test_pr_description_shows_the_main_verified_series_diff():
    """docs/upstream-pr.md quotes the diff; it must be the one in the series, byte for byte."""
    doc = (ROOT / "docs" / "upstream-pr.md").read_text(encoding="utf-8")
    quoted = re.search(r"```diff\n(.*?)```", doc, re.S)
    assert quoted, "docs/upstream-pr.md has no ```diff block"
    version = read_pin("main-verified").version
    if version is None:
        pytest.skip("main-verified is not an exact release")
    (series,) = [s for s in SERIES if s.ref == f"v{version}"]
    patch = series.patches[0].read_text(encoding="utf-8")
    scheduler_part = patch.split(f"+++ b/{SCHEDULER_PATH}\n", 1)[1]
    assert quoted.group(1) == scheduler_part
