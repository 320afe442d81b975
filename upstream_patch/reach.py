"""Version reach: the seam on every vLLM release from the release-tag pin to the newest.

    python upstream_patch/reach.py [--versions 0.24.0 0.25.0 ...] [--own-tests] [--table FILE]

For each release (default: every final release that ``pip index versions vllm`` lists, from the
release-tag pin's version up):

- applies: the series named after the release (``upstream_patch/v<release>/``) applies, strictly
  (no fuzz), to ``scheduler.py`` from that release's wheel, and the result compiles;
- neutral: tests/test_seam_neutrality.py passes against that release. The wheel is unpacked into
  a scratch directory put first on ``PYTHONPATH`` of a child pytest, so it shadows the vLLM of
  this environment without modifying it (the CPU runtime of requirements/ is shared);
- with ``--own-tests``: upstream_patch/run_vllm_tests.py on that release as well (vLLM's own
  test_scheduler.py, unpatched vs patched, plus the series' test).

The table goes to docs/seam-reach.md. Wheels are downloaded (``pip download --no-deps
--only-binary :all:``) into ``--wheel-dir`` once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tools"))
from run_vllm_tests import junit_outcomes  # noqa: E402
from seam_patch import (  # noqa: E402
    SCHEDULER_PATH,
    SEAM_METHOD,
    PatchError,
    scheduler_text,
    series_for_ref,
    version_key,
)

from pins import read_pin  # noqa: E402

NEUTRALITY_TESTS = "tests/test_seam_neutrality.py"


@dataclass
class Reach:
    release: str
    series: str = ""
    applies: str = "no"
    neutral: str = "not run"
    scheduler_diff: str = ""
    test_lines: int = 0
    condition: str = ""
    own_tests: str = ""
    notes: list[str] = field(default_factory=list)


def releases_from_index(first: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    listed = re.search(r"Available versions: (.*)", out)
    if not listed:
        raise SystemExit("reach.py: error: `pip index versions vllm` listed nothing")
    finals = [v.strip() for v in listed.group(1).split(",") if re.fullmatch(r"[\d.]+", v.strip())]
    return sorted((v for v in finals if version_key(v) >= version_key(first)), key=version_key)


def wheel_for(version: str, wheel_dir: Path) -> Path:
    found = sorted(wheel_dir.glob(f"vllm-{version}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
             "-d", str(wheel_dir), f"vllm=={version}"],
            check=True,
        )  # fmt: skip
        found = sorted(wheel_dir.glob(f"vllm-{version}-*.whl"))
    return found[0]


def seam_condition(patched: str) -> str:
    """What the default body checks, described (not quoted: vLLM's code stays in the patches)."""
    body = patched.split(f"def {SEAM_METHOD}(", 1)[1].split("\n    def ", 1)[0]
    limit = re.findall(r"self\.(max_num_\w+_reqs)", body)
    operator = re.findall(r"(>=|==|>)", body)
    described = f"{operator[-1] if operator else '?'} {limit[-1] if limit else '?'}"
    if "num_waiting_for_streaming_input" in body:
        described += ", counting paused streaming sessions"
    return described


def junit_counts(path: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for outcome in junit_outcomes(path).values():
        counts[outcome] += 1
    return counts


def check_release(version: str, args) -> Reach:
    result = Reach(release=version)
    series = series_for_ref(version)
    if series is None:
        result.notes.append(f"no upstream_patch/v{version}/ (run make_series.py {version})")
        return result
    result.series = series.ref
    wheel = wheel_for(version, args.wheel_dir)
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(SCHEDULER_PATH).decode("utf-8")
    try:
        patched = scheduler_text(source, series)
        compile(patched, SCHEDULER_PATH, "exec")
    except (PatchError, SyntaxError) as exc:
        result.notes.append(f"does not apply: {exc}")
        return result
    result.applies = "yes"
    (diff,) = series.scheduler_diffs()
    added = sum(ln[0] == "+" for h in diff.hunks for ln in h.lines)
    removed = sum(ln[0] == "-" for h in diff.hunks for ln in h.lines)
    result.scheduler_diff = f"+{added} -{removed}"
    result.test_lines = sum(d.changed_lines for d in series.file_diffs() if d.is_test)
    result.condition = seam_condition(patched)

    tree = args.work / f"v{version}"
    if not (tree / "vllm").is_dir():
        shutil.rmtree(tree, ignore_errors=True)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(tree)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("VLLM_BALANCE_SEAM", None)  # the unpacked release is unpatched; not a nox session
    junit = Path(tempfile.mkdtemp(prefix="reach-")) / "junit.xml"
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x",
         f"--junitxml={junit}", NEUTRALITY_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
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
        errors = [ln for ln in run.stdout.splitlines() if ln.startswith(("E ", "FAILED", "ERROR"))]
        result.notes.append((errors or [run.stdout.strip().splitlines()[-1:]])[0][:200])
    if args.own_tests:
        report = junit.parent / "own.json"
        own = subprocess.run(
            [sys.executable, str(HERE / "run_vllm_tests.py"), "--report", str(report)],
            cwd=ROOT, env=env, capture_output=True, text=True,
        )  # fmt: skip
        if report.exists():
            data = json.loads(report.read_text())
            ts, seam = data["test_scheduler"], data["seam_tests"]
            result.own_tests = (
                f"{'ok' if own.returncode == 0 else 'FAIL'}: upstream "
                f"{ts['unpatched']['passed']}/{ts['patched']['passed']} passed "
                f"(unpatched/patched), {ts['patched']['skipped']} skipped; seam tests "
                f"{seam['patched']['passed']} pass patched, {seam['unpatched']['failed']} fail "
                "unpatched"
            )
        else:
            result.own_tests = "error: " + (own.stderr.strip().splitlines() or ["?"])[-1][:150]
    if not args.keep:
        shutil.rmtree(tree, ignore_errors=True)
    return result


def write_table(results: list[Reach], path: Path, own_tests: bool) -> None:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    lines = [
        "# Seam version reach",
        "",
        "Measured by `nox -s seam-reach` (`python upstream_patch/reach.py`"
        + (" --own-tests" if own_tests else "")
        + f"), {datetime.date.today().isoformat()}, Python {python}, CPU only. Regenerate, do not "
        "edit by hand.",
        "",
        "- **applies**: the series `upstream_patch/v<release>/` applies to that release's "
        "`scheduler.py` (from its wheel) exactly, no fuzz, and the result compiles.",
        "- **neutral**: `tests/test_seam_neutrality.py` passes against that release (unpatched vs "
        "patched `Scheduler`, step-by-step identical outputs on named and randomized workloads, "
        "and the wrong-seam negative controls are caught).",
        "- **patch size**: lines added/removed in `scheduler.py`; lines of the new unit test.",
        "- **seam returns**: what the default body checks (running requests against the "
        "slot limit), i.e. that release's own stop condition; the code is in "
        "`upstream_patch/v<release>/`.",
        "- The neutrality suite has 13 tests; the 13th checks the nox seam flag and skips here.",
        "",
    ]
    header = "| release | applies | neutral | patch size | seam returns |"
    rule = "|---|---|---|---|---|"
    if own_tests:
        header += " vLLM's own tests |"
        rule += "---|"
    lines += [header, rule]
    for r in results:
        size = f"{r.scheduler_diff}; test +{r.test_lines}" if r.applies == "yes" else ""
        row = f"| {r.release} | {r.applies} | {r.neutral} | {size} | {r.condition} |"
        if own_tests:
            row += f" {r.own_tests} |"
        lines.append(row)
    notes = [f"- {r.release}: {n}" for r in results for n in r.notes]
    if notes:
        lines += ["", "Notes:", "", *notes]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def build_parser() -> argparse.ArgumentParser:
    """The command line, apart from main() so tests/test_doc_commands.py can parse the docs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="*", help="default: the index, from the release tag")
    parser.add_argument("--wheel-dir", type=Path, default=Path("/tmp/wheels"))
    parser.add_argument(
        "--work", type=Path, default=Path.home() / ".cache" / "vllm-balance" / "reach"
    )
    parser.add_argument("--own-tests", action="store_true", help="also run vLLM's own tests")
    parser.add_argument("--keep", action="store_true", help="keep the unpacked wheels")
    parser.add_argument("--table", type=Path, default=ROOT / "docs" / "seam-reach.md")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.wheel_dir.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    first = read_pin("release-tag").version
    versions = args.versions or releases_from_index(first or "0")
    results = []
    for version in versions:
        reach = check_release(version, args)
        print(
            f"{reach.release}: applies={reach.applies} neutral={reach.neutral} "
            f"size={reach.scheduler_diff} {reach.own_tests} {'; '.join(reach.notes)}",
            flush=True,
        )
        results.append(reach)
    write_table(results, args.table, args.own_tests)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    print(f"table: {args.table}")
    ok = all(r.applies == "yes" and r.neutral.startswith("yes") for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
