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


def record_fingerprints(evidence: dict) -> None:
    """compat/fingerprints.json: one entry per release whose compat path passed in reach.

    Entries for the CI pins stay until reach has verified them itself; a release whose compat
    run failed is removed (its fingerprint is no longer vouched for).
    """
    data = json.loads(FINGERPRINTS.read_text())
    entries = {e["release"]: e for e in data["verified"]}
    for release, entry in evidence.items():
        compat = entry.get("compat")
        if compat is None:
            continue
        if compat["ok"]:
            old = entries.get(release, {})
            # The hold chosen for this schedule() stays while its fingerprint does.
            hold = {
                k: v
                for k, v in old.items()
                if k in ("hold", "hold_evidence") and old["fingerprint"] == compat["fingerprint"]
            }
            entries[release] = {
                "release": release,
                "fingerprint": compat["fingerprint"],
                "date": compat["date"],
                "evidence": evidence_summary(compat),
                **hold,
            }
        else:
            entries.pop(release, None)
    data["verified"] = sorted(entries.values(), key=lambda e: Version(e["release"]))
    FINGERPRINTS.write_text(json.dumps(data, indent=2) + "\n")
