#!/usr/bin/env python3
"""Mutation check: every deliberately wrong variant must make the suite fail.

    python tests/mutation/run.py                    # baseline + every mutant of the active path
    python tests/mutation/run.py --mutant gate_wrong_cap --profile soak
    python tests/mutation/run.py --write-doc        # also write its column in docs/testing.md
    python tests/mutation/run.py --mutant X --write-doc   # only X's cells, same vLLM as the column

One pytest process per mutant (the mutant is applied by the ``pytest_mutant`` plugin before any
test module is imported), on the installed vLLM: the compat path without the seam, the shim path
with it. Each mutant runs the shared suite plus the files it names (``Mutant.files``: where the
killer of a bug outside the scheduler lives). The unmutated baseline runs first, on every file of
the run, and must pass; then each mutant must be killed, i.e. pytest must fail, and the table
lists which tests failed. Exit status 1 if the baseline fails or
a mutant survives.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mutants import MUTANTS

from balance_testbed.junit import junit_outcomes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

DOC = ROOT / "docs" / "testing.md"
SUITE = ["tests/test_differential.py", "tests/test_gate_oracle.py", "tests/test_contract.py"]
# Each no-seam path's own tests (the copy's delta 3 is reachable only through a selection
# returning None; the pause-state hold's rules and its differential against the contract's hold).
PATH_SUITES = {
    "compat": ["tests/test_compat_behaviour.py", "tests/test_compat_derive.py"],
    "pause-state": [
        "tests/test_pause_state_rules.py",
        "tests/test_pause_state_hold.py",
        "tests/test_async_kv_hold.py",
    ],
}


def run_pytest(mutant: str, files: list[str], profile: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="vllm-balance-mutant-") as tmp:
        report, junit = Path(tmp) / "applied.json", Path(tmp) / "junit.xml"
        env = dict(
            os.environ,
            VLLM_BALANCE_MUTANT=mutant,
            VLLM_BALANCE_MUTANT_REPORT=str(report),
            VLLM_BALANCE_DIFFERENTIAL_PROFILE=profile,
            PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        )
        command = [
            sys.executable, "-m", "pytest", "-p", "pytest_mutant", "-p", "no:cacheprovider",
            "-q", "-m", "not slow", f"--junitxml={junit}", *files,
        ]  # fmt: skip
        started = time.monotonic()
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        elapsed = time.monotonic() - started
        applied = json.loads(report.read_text()) if report.exists() else None
        failed = _failed_tests(junit) if junit.exists() else []
    return {
        "mutant": mutant,
        "returncode": result.returncode,
        "applied": applied,
        "failed": failed,
        "seconds": elapsed,
        "tail": (result.stdout + result.stderr)[-3000:],
    }


def _failed_tests(junit: Path) -> list[str]:
    """``module::test`` of every failed (or errored) test."""
    return [
        f"{test_id.split('::')[0].rsplit('.', 1)[-1]}::{test_id.split('::', 1)[1]}"
        for test_id, outcome in junit_outcomes(junit).items()
        if outcome == "failed"
    ]


def has_target(name: str) -> bool:
    """``MUTANTS[name].has_target()``, asked in a child (this process imports no vLLM)."""
    code = f"import mutants; print(mutants.MUTANTS[{name!r}].has_target())"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    return out.stdout.strip().splitlines()[-1] == "True"


def active_path() -> str:
    code = "import vllm_balance; print(vllm_balance.active_path())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip().splitlines()[-1]


def table(path: str, vllm_version: str, rows: list[dict], command: str) -> str:
    """This run's results as a table of its own (printed; the doc gets them through write_doc)."""
    lines = [
        f"#### {path} path (vLLM {vllm_version})",
        "",
        f"`{command}`",
        "",
        "| mutant | what is wrong | killed | killed by |",
        "|---|---|---|---|",
    ]
    for name, result in path_results(rows).items():
        by = "<br>".join(f"`{t}`" for t in result["failed"]) or "-"
        lines.append(f"| `{name}` | {wrong_of(name)} | {result['cell']} | {by} |")
    return "\n".join(lines) + "\n"


def killed(row: dict) -> bool:
    return row["returncode"] != 0 and bool(row["failed"])


def wrong_of(name: str) -> str:
    return "unmutated baseline (must pass)" if name == "none" else MUTANTS[name].wrong


def path_results(rows: list[dict]) -> dict[str, dict]:
    """Per mutant of one run: its cell in that path's column and the tests that failed."""
    results = {}
    for row in rows:
        if row.get("no_target"):
            results[row["mutant"]] = {"cell": NO_TARGET, "failed": []}
            continue
        if row["mutant"] == "none":
            verdict = "passes" if row["returncode"] == 0 else "**FAILS**"
        else:
            verdict = "yes" if killed(row) else "**NO**"
        cell = f"{verdict}, {row['seconds']:.0f} s"
        results[row["mutant"]] = {"cell": cell, "failed": row["failed"]}
    return results


# The doc's one kill table: a column per path, the killers of every path in one list (a killer
# that failed on some of the paths that ran names them).
KILL_TABLE = ("<!-- kill-table:start -->", "<!-- kill-table:end -->")
PATHS = ("pause-state", "compat", "shim")
NO_TARGET, NOT_RUN, NOT_ON_PATH = "n/a: no target in this vLLM", "not run", "-"
HEADER = re.compile(r"^\| mutant \| what is wrong \| (?P<columns>.+) \| killed by \|$")
COLUMN = re.compile(r"(?P<path>[\w-]+) \(vLLM (?P<version>[^)]+)\)")


def kill_table(versions: dict[str, str], results: dict[str, dict[str, dict]]) -> str:
    """The doc's table from each path's results; a killer that failed on only some of the paths
    that ran names those paths."""
    columns = " | ".join(f"{path} (vLLM {versions[path]})" for path in PATHS)
    rule = "|---" * (len(PATHS) + 3) + "|"
    lines = [f"| mutant | what is wrong | {columns} | killed by |", rule]
    for name in ["none", *MUTANTS]:
        cells = [column_cell(name, path, results[path]) for path in PATHS]
        ran = [p for p in PATHS if name in results[p] and results[p][name]["cell"] != NO_TARGET]
        failed = {path: results[path][name]["failed"] for path in ran}
        by = []
        for test in dict.fromkeys(t for path in ran for t in failed[path]):
            only = [path for path in ran if test in failed[path]]
            by.append(f"`{test}`" + ("" if len(only) == len(ran) else f" ({', '.join(only)})"))
        row = [f"`{name}`", wrong_of(name), *cells, "<br>".join(by) or "-"]
        lines.append(f"| {' | '.join(row)} |")
    return "\n".join(lines) + "\n"


def column_cell(name: str, path: str, results: dict[str, dict]) -> str:
    if name in results:
        return results[name]["cell"]
    return NOT_ON_PATH if name != "none" and path not in MUTANTS[name].paths else NOT_RUN


def read_kill_table(text: str) -> tuple[dict[str, str], dict[str, dict[str, dict]]]:
    """The versions and per-path results the doc's table holds (the inverse of kill_table)."""
    section = text.split(KILL_TABLE[0], 1)[1].split(KILL_TABLE[1], 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = HEADER.match(lines[0])
    columns = [COLUMN.fullmatch(c) for c in header["columns"].split(" | ")] if header else [None]
    if header is None or None in columns or not {c["path"] for c in columns} <= set(PATHS):
        raise SystemExit(f"{DOC}: the kill table's header is not columns of {PATHS}")
    # A path the table has no column for yet (a new path) starts as "not run".
    versions = {path: "-" for path in PATHS} | {c["path"]: c["version"] for c in columns}
    results: dict[str, dict[str, dict]] = {path: {} for path in PATHS}
    for line in lines[2:]:
        name, _wrong, *cells, by = (cell.strip() for cell in line.strip("|").split(" | "))
        name = name.strip("`")
        killers = [] if by == "-" else by.split("<br>")
        for path, cell in zip((c["path"] for c in columns), cells):
            if cell in (NOT_RUN, NOT_ON_PATH):
                continue
            failed = [k.split("`")[1] for k in killers if path in killed_on(k, columns)]
            results[path][name] = {"cell": cell, "failed": [] if cell == NO_TARGET else failed}
    return versions, results


def killed_on(killer: str, columns: list) -> list[str]:
    """The paths a "killed by" entry failed on: every column's, or those it names after it."""
    named = killer.rsplit("`", 1)[1].strip(" ()")
    return named.split(", ") if named else [c["path"] for c in columns]


def write_doc(path: str, vllm_version: str, rows: list[dict], partial: bool = False) -> None:
    """Replace ``path``'s column of the doc's kill table with this run's results; ``partial``
    (a run of named mutants): replace only their cells, in a column of the same vLLM."""
    text = DOC.read_text(encoding="utf-8")
    head, found, rest = text.partition(KILL_TABLE[0])
    if not found or KILL_TABLE[1] not in rest:
        raise SystemExit(f"{DOC}: no {KILL_TABLE[0]} ... {KILL_TABLE[1]} markers")
    tail = rest.split(KILL_TABLE[1], 1)[1]
    versions, results = read_kill_table(text)
    if partial and versions[path] != vllm_version:
        raise SystemExit(
            f"the {path} column is vLLM {versions[path]}'s, this run's is {vllm_version}: "
            "write a whole column (no --mutant) or run on that vLLM"
        )
    if partial:  # the named mutants' cells; the column's baseline stays the whole run's
        results[path].update({k: v for k, v in path_results(rows).items() if k != "none"})
    else:
        versions[path], results[path] = vllm_version, path_results(rows)
    section = kill_table(versions, results)
    DOC.write_text(f"{head}{KILL_TABLE[0]}\n{section}{KILL_TABLE[1]}{tail}", encoding="utf-8")


def build_parser() -> argparse.ArgumentParser:
    """The command line, apart from main() so tests can parse arguments without running."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutant", action="append", choices=sorted(MUTANTS), default=None)
    parser.add_argument("--profile", choices=("ci", "soak"), default="ci")
    parser.add_argument("--write-doc", action="store_true")
    return parser


def main() -> int:
    args = build_parser().parse_args()

    import importlib.metadata

    vllm_version = importlib.metadata.version("vllm")
    path = active_path()
    if path not in PATHS:
        raise SystemExit(
            f"vLLM {vllm_version} takes the {path} path, which the kill table has no column for "
            f"yet (its columns: {', '.join(PATHS)}); run on a vLLM with the seam applied"
        )
    shared = SUITE + PATH_SUITES.get(path, [])
    names = args.mutant or [n for n, m in MUTANTS.items() if path in m.paths]
    # A mutant whose target this release lacks would "survive" by changing nothing.
    no_target = {n for n in names if MUTANTS[n].has_target and not has_target(n)}
    names = [n for n in names if n not in no_target]
    own_files = {name: [f for f in MUTANTS[name].files if f not in shared] for name in names}
    own_files["none"] = list(dict.fromkeys(f for name in names for f in own_files[name]))
    print(f"vLLM {vllm_version}, {path} path; shared suite: {' '.join(shared)}", flush=True)
    rows = []
    for name in ["none", *names]:
        row = run_pytest(name, shared + own_files[name], args.profile)
        rows.append(row)
        if row["applied"] is None or row["applied"]["mutant"] != name:
            print(row["tail"])
            raise SystemExit(f"mutant {name}: the plugin did not apply it; see the output above")
        if row["applied"]["path"] != path:
            raise SystemExit(f"mutant {name} ran on the {row['applied']['path']} path")
        status = "passes" if row["returncode"] == 0 else f"fails: {row['failed']}"
        print(f"{name}: {status} ({row['seconds']:.0f}s)", flush=True)
        if name == "none" and row["returncode"] != 0:
            print(row["tail"])
            print("baseline fails: fix the suite before reading any kill table")
            return 1
    command = " ".join(
        ["python tests/mutation/run.py", *(f"--mutant {name}" for name in args.mutant or ())]
        + (["--write-doc"] if args.write_doc else [])
    )
    rows += [{"mutant": n, "no_target": True} for n in sorted(no_target)]
    section = table(path, vllm_version, rows, command)
    print(section)
    if args.write_doc:
        write_doc(path, vllm_version, rows, partial=bool(args.mutant))
    survivors = [r["mutant"] for r in rows[1:] if not r.get("no_target") and not killed(r)]
    if survivors:
        print(f"surviving mutants: {', '.join(survivors)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
