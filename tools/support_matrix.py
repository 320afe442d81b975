#!/usr/bin/env python3
"""Generate (or check) docs/support-matrix.md from the repository's own records.

Which path runs on a vLLM release, and what backs it, follows from four places: the pin files
(pins/*.txt, what CI runs), the seam series (upstream_patch/v<release>/, and which one serves each
release and how its patch fared, as reach recorded it), the verified fingerprints
the compat path accepts at run time (compat/fingerprints.json) and the per-release runs of
``nox -s reach`` (docs/reach-evidence.json). Generating the tables from them means they cannot
drift: the lint session runs ``--check`` (noxfile.py). Only the document's
generated blocks are written (``fill``); its prose is edited in the document. A cell says "verified"
only when the reach run of that release and path passed (or, for a pin, CI runs it).

usage: support_matrix.py [--check]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

from packaging.version import Version

from balance_sim.markdown import markdown_table
from balance_testbed.pins import PIN_NAMES, read_pin
from balance_testbed.records import EVIDENCE, FINGERPRINTS
from balance_testbed.seam_patch import all_series, serving_series

ROOT = Path(__file__).resolve().parent.parent

DOC = ROOT / "docs" / "support-matrix.md"
DATE_PREFIX = "Generated on "
# A generated block of a document: between these two lines; the prose around it is written in the
# document itself (its one place) and kept as it is.
GENERATED = re.compile(r"<!-- generated: ([\w-]+) -->\n.*?<!-- end -->", re.S)
# Which CI session runs a pin's path; "no-seam" is whichever hold the release's record names.
CI_SESSIONS = {
    "release-tag": {"no-seam": "`tests-release`", "shim": "`tests-release-seam`"},
    "main-verified": {"no-seam": "`tests-main`", "shim": ""},
    "seam-verified": {"no-seam": "", "shim": "`tests-main-seam`"},
    "e2e": {"no-seam": "`e2e`: vllm-cpu, a real server", "shim": "`e2e`: vllm-cpu, a real server"},
}
LABELS = {"pause-state": "pause-state", "compat": "compat (derived copy)", "shim": "shim"}


def _counts(counts: dict) -> str:
    if not counts:
        return "-"
    failed = f", {counts['failed']} failed" if counts.get("failed") else ""
    return f"{counts['passed']} passed{failed}"


def _own_tests(own: dict) -> str:
    if not own:
        return "not run"
    if "error" in own:
        return f"error: {own['error']}"
    balance, upstream = own["balance"]["passed"], own["upstream"]["passed"]
    return f"{balance} passed / upstream {upstream}, {own['lost']} lost"


def _path_row(
    release: str, path: str, run: dict | None, pins: list[str], usable: str, serving: bool
) -> list[str]:
    # One release can be several pins (the release tag is also the e2e server's vLLM).
    key = "shim" if path == "shim" else "no-seam"
    ci = "; ".join(filter(None, (CI_SESSIONS[pin][key] for pin in pins if serving)))
    label = LABELS[path]
    if run is None:
        verdict = f"CI ({ci})" if ci else "not run"
        return [release, label, usable, verdict, "-", "-", "-", "-"]
    verdict = "verified" if run["ok"] else "FAILED: " + "; ".join(run["notes"])[:160]
    if ci:
        verdict += f"; CI ({ci})"
    counts = [_counts(run["differential"]), _counts(run["contract"]), _own_tests(run["own_tests"])]
    return [release, label, usable, verdict, *counts, run["date"]]


def _seam_rows(evidence: dict) -> list[str]:
    """The seam series per release, as ``nox -s reach`` recorded it."""
    rows, notes = [], []
    for release in sorted(evidence, key=Version):
        seam = evidence[release].get("seam")
        if seam is None:
            continue
        size = f"{seam['scheduler_diff']}; test +{seam['test_lines']}" if seam["series"] else ""
        rows.append(
            [release, seam["applies"], seam["neutral"], size, seam["condition"], seam["date"]]
        )
        notes += [f"- {release}: {n}" for n in seam["notes"]]
    lines = markdown_table(
        "release | applies | neutral | patch size | called after the slot check | date", rows
    )
    return lines + (["", "Notes:", "", *notes] if notes else [])


def render(today: str) -> str:
    pinned: dict[str | None, list[str]] = {}
    for name in PIN_NAMES:
        pinned.setdefault(read_pin(name).version, []).append(name)
    # The no-seam path's hold per verified schedule() (compat/pause_state.py reads the same).
    holds = {
        e["release"]: e.get("hold", "derived-copy")
        for e in json.loads(FINGERPRINTS.read_text())["verified"]
    }
    compat = set(holds)
    evidence = json.loads(EVIDENCE.read_text()) if EVIDENCE.exists() else {}
    series = {s.ref.removeprefix("v"): s.ref for s in all_series()}
    for release, runs in evidence.items():
        served = serving_series(release)
        if runs.get("seam", {}).get("applies") == "yes" and served is not None:
            series[release] = served.ref
    releases = sorted(set(series) | compat | set(evidence) | set(pinned) - {None}, key=Version)
    rows, costs, cpu = [], [], []
    for release in releases:
        runs = evidence.get(release, {})
        pins = pinned.get(release, [])
        name = f"{release} ({', '.join(pins)})" if pins else release
        hold = holds.get(release)
        # The no-seam row is the hold the record names (pause-state where none is recorded, as
        # at run time); a pause-state run that lost to the derived copy keeps its row, unused.
        no_seam = "compat" if hold == "derived-copy" else "pause-state"
        usable = {
            no_seam: "yes (fingerprint verified)" if hold else "yes, with a warning (unverified)",
            "shim": (
                f"with `upstream_patch/{series[release]}/`" if release in series else "no series"
            ),
        }
        if no_seam == "compat" and "pause-state" in runs:
            usable = {"pause-state": "no: the derived copy holds here", **usable}
        rows += [
            _path_row(name, path, runs.get(path), pins, usable[path], path in (no_seam, "shim"))
            for path in usable
        ]
        if "cost" in runs:
            cost = runs["cost"]
            minutes = [
                f"{runs[path]['seconds'] / 60:.0f}" if path in runs else "-" for path in LABELS
            ]
            sizes = [cost[key] for key in ("wheel_mb", "unpacked_mb", "sdist_mb")]
            costs.append([release, *minutes, *sizes, cost["date"]])
        if "vllm_cpu" in runs:
            check = runs["vllm_cpu"]
            same = "same" if check["same"] else "DIFFERENT"
            cpu.append(
                f"- {release}: `{check['wheel']}` has the {same} fingerprint ({check['date']})."
            )
    return fill(
        DOC,
        {
            "date": [f"{DATE_PREFIX}{today}."],
            "matrix": markdown_table(
                "vLLM release | path | usable | verdict | differential | contract "
                "| vLLM's own tests | date",
                rows,
                spaced_rule=True,
            ),
            "costs": markdown_table(
                "release | pause-state minutes | compat minutes | shim minutes | wheel MB "
                "| unpacked MB | sdist MB | date",
                costs,
                spaced_rule=True,
            ),
            "cpu-builds": cpu or ["- none checked yet."],
            "seam-reach": _seam_rows(evidence),
            "metrics": [
                f"- {release} ({', '.join(pins)})" for release, pins in pinned.items() if release
            ],
        },
    )


def fill(doc: Path, blocks: dict[str, list[str]]) -> str:
    """``doc``'s text with each generated block's lines replaced by ``blocks[name]``."""

    def block(match: re.Match) -> str:
        # Blank lines around the block: a line right after a table would join the table.
        lines = "\n".join(blocks[match[1]])
        return f"<!-- generated: {match[1]} -->\n\n{lines}\n\n<!-- end -->"

    text = doc.read_text(encoding="utf-8")
    if missing := set(blocks) - set(GENERATED.findall(text)):
        raise ValueError(f"{doc} has no generated block {sorted(missing)}")
    return GENERATED.sub(block, text)


def without_date(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith(DATE_PREFIX)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    current = render(datetime.date.today().isoformat())
    if args.check:
        if not DOC.exists() or without_date(DOC.read_text()) != without_date(current):
            print(f"{DOC.relative_to(ROOT)} is stale: run python tools/support_matrix.py")
            return 1
        return 0
    DOC.write_text(current)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
