"""The patch series in upstream_patch/ are what a vLLM reviewer should receive.

Each series is a commit message explaining why, then a diff that touches only the scheduler and
vLLM's tests/v1/core/test_scheduler.py (cases added beside its throttle tests; before 0.31 also the
factory parameter they use), keeps the scheduler diff small and adds only the seam: the call, the
default and their docstrings, no policy. It
carries no author and no ``Signed-off-by``: the submitter commits and signs off with their own
identity. A series is stored only where its text differs, and what is stored is what
``make_series.py`` generates (from the release's wheel and sdist: the byte-for-byte checks fetch
the installed release's sdist once, into the cache).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from balance_testbed.pins import SEAM_PIN_NAMES, read_pin
from balance_testbed.seam_patch import (
    SCHEDULER_PATH,
    SEAM_METHOD,
    SEAM_TEST_PATH,
    TEST_UTILS_PATH,
    added_lines,
    all_series,
    installed_version,
    installed_vllm_root,
    match_series,
    numstat,
    scheduler_text,
    seam_stops_before_installed,
    serving_series,
)
from upstream_patch.make_series import FRESH, TESTS_AFTER, authored, check_series, series_form

ROOT = Path(__file__).resolve().parent.parent

SERIES = all_series()


@pytest.fixture
def served():
    """The installed release, where a series serves it (none past the seam's last release)."""
    if reason := seam_stops_before_installed():
        pytest.skip(reason)
    return installed_version()


def unpatched_installed_source() -> str:
    source = (installed_vllm_root() / SCHEDULER_PATH).read_text(encoding="utf-8")
    match = match_series(source, installed_version() or None)
    return scheduler_text(source, match.series, reverse=True) if match.already_seamed else source


def test_every_seam_sessions_pin_is_served_by_a_series():
    for name in SEAM_PIN_NAMES:
        pin = read_pin(name)
        if pin.version is None:
            pytest.skip(f"pin {name} is not an exact release: {pin.requirement}")
        assert serving_series(pin.version) is not None, f"no series serves pin {name}"


@pytest.mark.parametrize("series", SERIES, ids=lambda s: s.ref)
def test_series_is_a_message_then_a_diff_with_no_identity(series):
    for patch in series.patches:
        text = patch.read_text(encoding="utf-8")
        message, diff = text.split("\n---\n", 1)
        assert message.startswith("[Core] ")
        assert len(message.split()) > 80, "the message must explain why, not only what"
        assert diff.count("\ndiff --git ") == len(numstat(series))
        # No author, date or sign-off: whoever submits it commits and signs off as themselves.
        assert not re.search(r"^(From|Date|Signed-off-by|Author):", text, re.M)
        assert "@" not in message


@pytest.mark.parametrize("series", SERIES, ids=lambda s: s.ref)
def test_series_touches_the_scheduler_and_adds_to_its_tests_beside_the_throttle_tests(series):
    counts = numstat(series)
    assert {SCHEDULER_PATH, SEAM_TEST_PATH} <= set(counts)
    assert set(counts) <= {SCHEDULER_PATH, SEAM_TEST_PATH, TEST_UTILS_PATH}
    assert counts[SEAM_TEST_PATH][1] == 0, "cases are added; vLLM's own tests stay as they are"
    text = series.patches[0].read_text(encoding="utf-8")
    tests_diff = text.split(f"+++ b/{SEAM_TEST_PATH}\n", 1)[1].split("\ndiff --git ", 1)[0]
    (hunk,) = re.findall(r"^@@ .*$", tests_diff, re.M)
    assert hunk.endswith(f"def {TESTS_AFTER}():"), "the cases go right after the throttle tests"
    # Before 0.31 only: create_scheduler() gets scheduler_cls, as 0.31 gave it.
    assert counts.get(TEST_UTILS_PATH, (3, 1)) == (3, 1)
    added_to_utils = "".join(added_lines(series, TEST_UTILS_PATH))
    assert "scheduler_cls" in added_to_utils or TEST_UTILS_PATH not in counts


def scheduler_diff_lines(series) -> list[str]:
    text = series.patches[0].read_text(encoding="utf-8")
    return text.split(f"+++ b/{SCHEDULER_PATH}\n", 1)[1].split("\ndiff --git ", 1)[0].splitlines()


@pytest.mark.parametrize("series", SERIES, ids=lambda s: s.ref)
def test_scheduler_diff_is_the_call_and_the_default_only(series):
    lines = scheduler_diff_lines(series)
    added = [ln[1:].strip() for ln in lines if ln.startswith("+")]
    assert not [ln for ln in lines if ln.startswith("-")], "nothing of vLLM's is changed"
    assert f"def {SEAM_METHOD}(self) -> bool:" in added and "return False" in added
    # Scheduler gets a class docstring naming the method as an override point.
    class_line = lines.index(" class Scheduler(SchedulerInterface):")
    assert lines[class_line + 1].startswith('+    """') and SEAM_METHOD in "".join(added[:6])
    # Called right after the release's own slot check, which stays inline (context lines).
    start = next(i for i, ln in enumerate(lines) if ln.startswith("+") and "if " in ln)
    call = lines[start : start + 5] if series_form(series) == FRESH else lines[start : start + 2]
    assert lines[start - 1].strip() == "break" and lines[start - 1].startswith(" ")
    assert lines[start - 2].startswith(" ") and "self.max_num_" in lines[start - 2]
    pad = " " * 16
    if series_form(series) == FRESH:  # 0.31+: KV-holders are drained first and not held
        assert call == [
            f"+{pad}if (",
            f"+{pad}    request_queue is self.waiting",
            f"+{pad}    and self.{SEAM_METHOD}()",
            f"+{pad}):",
            f"+{pad}    break",
        ]
    else:
        assert call == [f"+{pad}if self.{SEAM_METHOD}():", f"+{pad}    break"]
    # No policy: nothing but the call, the method and the two docstrings.
    policy = ("prefill_capacity_bound", "balance_gate", "deferred")
    assert not any(name in line for line in added for name in policy)
    added_lines_count, removed_lines_count = numstat(series)[SCHEDULER_PATH]
    assert added_lines_count + removed_lines_count <= 30, "the change must stay reviewable"


def test_the_installed_release_regenerates_byte_for_byte(served):
    """make_series.py gives exactly what is stored for the installed release (its own series, or
    the newer one that serves it); a hand edit to either shows up here."""
    assert check_series(installed_version(), unpatched_installed_source()) is None


def test_check_catches_a_series_that_is_not_what_the_generator_gives(monkeypatch, served):
    """Negative control: a change to the authored message (the newest series') that the stored
    series lack is reported."""
    from upstream_patch import make_series

    hand = authored(series_form(serving_series(installed_version())))
    changed = hand._replace(message=hand.message.replace("The case at hand", "The case in point"))
    assert changed != hand
    monkeypatch.setattr(make_series, "authored", lambda form: changed)
    assert check_series(installed_version(), unpatched_installed_source()) is not None


def test_check_catches_a_test_case_the_stored_series_lack(monkeypatch, served):
    """Negative control: the authored test cases are in every series, so a case added to them
    shows up in the check of every release."""
    from upstream_patch import make_series

    hand = authored(series_form(serving_series(installed_version())))
    added = hand._replace(tests=hand.tests + "\n\ndef test_x():\n    pass\n")
    monkeypatch.setattr(make_series, "authored", lambda form: added)
    assert check_series(installed_version(), unpatched_installed_source()) is not None


def test_check_catches_a_method_docstring_the_stored_series_lack(monkeypatch, served):
    """Negative control: the method's docstring, too, is read from the newest series."""
    from upstream_patch import make_series

    hand = authored(series_form(serving_series(installed_version())))
    assert hand.method_head.startswith(f"    def {SEAM_METHOD}(self) -> bool:\n")
    changed = hand._replace(method_head=hand.method_head.replace("requests stall", "hang"))
    assert changed != hand
    monkeypatch.setattr(make_series, "authored", lambda form: changed)
    assert check_series(installed_version(), unpatched_installed_source()) is not None


def test_series_texts_differ_pairwise():
    """Only series whose text differs are stored (blob ids and line numbers aside)."""
    from upstream_patch.make_series import _LOCATION

    texts = [_LOCATION.sub("", s.patches[0].read_text(encoding="utf-8")) for s in SERIES]
    assert len(set(texts)) == len(texts)


@pytest.mark.parametrize("series", SERIES, ids=lambda s: s.ref)
def test_added_lines_fit_vllm_line_length(series):
    added = [ln[1:] for ln in series.patches[0].read_text().splitlines() if ln.startswith("+")]
    assert max(len(line) for line in added) <= 88  # vLLM's ruff line-length


def test_pr_description_names_the_newest_series_and_agrees_with_its_message():
    """upstream_patch/PR.md is against the newest release, pastes no diff (the series is the
    diff), and says what the commit message says of schedule()'s size."""
    doc = (ROOT / "upstream_patch" / "PR.md").read_text(encoding="utf-8")
    newest = SERIES[-1]
    assert f"vLLM {newest.ref.removeprefix('v')}" in doc
    assert f"upstream_patch/{newest.ref}/seam.patch" in doc
    assert "```diff" not in doc
    (size,) = set(re.findall(r"(\d,\d{3})\s+lines", authored().message))
    assert f"{size} lines" in doc


def test_the_pr_example_holds_back_admission_on_async_scheduling():
    """upstream_patch/PR.md's example, run as written, on a real AsyncScheduler with the seam:
    frozen, it admits nothing; released, it admits (the seam sessions run it)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    if not hasattr(AsyncScheduler, SEAM_METHOD):
        pytest.skip("this vLLM has no seam (the *-seam sessions apply it)")
    from balance_testbed.factories import make_request, make_scheduler, request_specs

    doc = (ROOT / "upstream_patch" / "PR.md").read_text(encoding="utf-8")
    example = re.search(r"```python\n(.*?)```", doc, re.S)
    assert example, "upstream_patch/PR.md has no ```python example"
    namespace: dict = {}
    exec(example.group(1), namespace)
    scheduler = make_scheduler(namespace["BalanceScheduler"], async_scheduling=True)
    scheduler.admission_frozen = True
    for spec in request_specs(3):
        scheduler.add_request(make_request(spec))

    assert scheduler.schedule().scheduled_new_reqs == []

    scheduler.admission_frozen = False
    assert len(scheduler.schedule().scheduled_new_reqs) == 3
