"""upstream_patch/pause-tests/: the tests-only PR that pins PAUSED_NEW at each admission site.

The product's frozen step is vLLM's one-step ``PAUSED_NEW`` (compat/pause_state.py), so what we
offer vLLM is tests of exactly that (upstream_patch/README.md, "The decision"). Checked here: its
form, and where the installed vLLM is a release it is stored for (the main-verified pin's
sessions), that its cases pass on ``scheduler.py`` as shipped and that each stored mutant (one
guard changed) fails at least one of them. vLLM's own tests beside them, per mutant:
``nox -s vllm-own-tests -- --pause-tests``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from balance_testbed.seam_patch import (
    PAUSE_TESTS_ROOT,
    SCHEDULER_PATH,
    all_series,
    installed_version,
    installed_vllm_root,
    mutants,
    pause_tests_series,
    scheduler_text,
)

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "upstream_patch" / "run_vllm_tests.py"
SERIES = all_series(PAUSE_TESTS_ROOT)
INSTALLED = pause_tests_series(installed_version())
needs_stored_release = pytest.mark.skipif(
    INSTALLED is None, reason="the installed vLLM is not a release the PR is stored for"
)


def test_the_pr_is_stored_for_at_least_one_release():
    assert SERIES, f"no series under {PAUSE_TESTS_ROOT}"


@pytest.mark.parametrize("series", SERIES, ids=lambda s: s.ref)
def test_the_pr_is_a_message_then_a_tests_only_diff_with_no_identity(series):
    [patch] = series.patches
    text = patch.read_text(encoding="utf-8")
    message, separator, diff = text.partition("\n---\n")
    assert separator and message.startswith("[Core][Tests] "), message[:80]
    # The sign-off and the AI-assistance trailer are the submitter's to give (README.md).
    assert not re.search(r"^(From|Signed-off-by|Co-authored-by):", text, re.M)
    paths = re.findall(r"^diff --git a/(\S+) ", diff, re.M)
    assert paths and all(path.startswith("tests/") for path in paths), paths
    assert mutants(series), "no mutants: nothing shows the tests can fail"


@needs_stored_release
def test_every_mutant_changes_the_installed_scheduler():
    source = (installed_vllm_root() / SCHEDULER_PATH).read_text(encoding="utf-8")
    for mutant in mutants(INSTALLED):
        assert scheduler_text(source, mutant) != source, mutant.ref


@needs_stored_release
def test_the_pr_cases_pass_as_shipped_and_each_mutant_fails_one(tmp_path):
    report_path = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, str(RUN), "--pause-tests", "--report", str(report_path),
         "--", "-k", "pause_new"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert report["by_file"]["as-shipped"]["the series' tests"]["passed"] >= 5
    assert set(report["mutants"]) == {mutant.ref for mutant in mutants(INSTALLED)}
    for name, verdict in report["mutants"].items():
        assert verdict["killed_by"], name
