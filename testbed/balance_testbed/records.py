"""The records of ``nox -s reach``: where they live and how a run's fingerprints are written
(upstream_patch/reach.py writes them, tools/support_matrix.py renders the matrix from them)."""

from __future__ import annotations

import json

from packaging.version import Version

from balance_testbed import REPO

EVIDENCE = REPO / "docs" / "reach-evidence.json"
FINGERPRINTS = REPO / "compat" / "fingerprints.json"


def evidence_summary(path: dict) -> str:
    """One line for compat/fingerprints.json: what passed, from which command."""
    diff, contract, own = path["differential"], path["contract"], path["own_tests"]
    text = (
        f"nox -s reach: differential {diff['passed']} passed, contract {contract['passed']} passed"
    )
    if own:
        text += (
            f", vLLM's own test_scheduler.py {own['balance']['passed']} passed "
            f"({own['lost']} lost vs upstream)"
        )
    return text


def hold_of(entry: dict, old: dict) -> dict:
    """The hold a release's run chose: ``pause-state`` where that path passed, ``derived-copy``
    with the pause-state path's first difference where only the copy passed; with no pause-state
    run, what the record said while the fingerprint is unchanged."""
    pause = entry.get("pause-state")
    if pause is None:
        return {k: v for k, v in old.items() if k in ("hold", "hold_evidence")}
    if pause["ok"]:
        return {
            "hold": "pause-state",
            "hold_evidence": f"{pause['date']}, {evidence_summary(pause)}",
        }
    difference = "; ".join(pause["notes"]) or "the pause-state path failed"
    return {"hold": "derived-copy", "hold_evidence": f"{pause['date']}, {difference}"}


def record_fingerprints(evidence: dict) -> None:
    """compat/fingerprints.json: one entry per release whose pause-state or compat path passed
    in reach, with the hold a frozen step gets there (``hold_of``).

    Entries for the CI pins stay until reach has verified them itself; a release whose no-seam
    runs all failed is removed (its fingerprint is no longer vouched for).
    """
    data = json.loads(FINGERPRINTS.read_text())
    entries = {e["release"]: e for e in data["verified"]}
    for release, entry in evidence.items():
        runs = [entry[p] for p in ("pause-state", "compat") if p in entry]
        if not runs:
            continue
        passed = [run for run in runs if run["ok"]]
        if not passed:
            entries.pop(release, None)
            continue
        serving, fingerprint = passed[0], passed[0]["fingerprint"]
        old = entries.get(release, {})
        entries[release] = {
            "release": release,
            "fingerprint": fingerprint,
            "date": serving["date"],
            "evidence": evidence_summary(serving),
            **hold_of(entry, old if old.get("fingerprint") == fingerprint else {}),
        }
    data["verified"] = sorted(entries.values(), key=lambda e: Version(e["release"]))
    FINGERPRINTS.write_text(json.dumps(data, indent=2) + "\n")
