"""Run vLLM's own scheduler tests on the unpatched and the patched scheduler of the installed vLLM.

    python upstream_patch/run_vllm_tests.py [--release X] [--report FILE] [--balance] [-- ARGS]
    python upstream_patch/run_vllm_tests.py --release X --in-tree [--report FILE] [-- ARGS]
    python upstream_patch/run_vllm_tests.py [--release X] --pause-tests [--report FILE] [-- ARGS]

This is what an upstream reviewer's CI runs first. ``--release X`` runs on vLLM release X instead
of the installed vLLM: its unpacked wheel shadows the installed one in the test processes
(``seam_patch.unpacked_release``, as in ``reach.py``). Steps:

1. The sdist of the installed vLLM version (it carries ``tests/``) is fetched from the package
   registry and cached (``seam_patch.fetch_sdist``).
2. vLLM's ``tests/`` is extracted, without its ``conftest.py`` files (they import model runners
   and hub clients), and the series' test part is applied to it (``git apply --include=tests/*``:
   its cases added to ``test_scheduler.py``, beside its throttle tests; before 0.31 also
   ``scheduler_cls``, which the unpatched side's tests ignore); pytest runs
   ``tests/v1/core/test_scheduler.py`` and ``test_async_scheduler.py`` (``--balance``: the first
   only, without the series). ``balance_testbed.vllm_own_conftest`` replaces the conftests.
3. pytest runs twice, in separate processes: once on the unpatched scheduler and once on the
   patched one. One side is the installed module; the other is the installed source with the
   series applied (or reverted, for an already-seamed vLLM), installed as
   ``vllm.v1.core.sched.scheduler`` by the conftest before any test imports it. The conftest
   reports which side it got, and the script checks it.

Pass: the patched side passes every test of vLLM's the unpatched side passes (same skips); the
series' own tests (the functions it adds) all pass on the patched side and each fails on the
unpatched side (each tells the two apart), and none fails there only because the method is
missing (an ``AttributeError`` naming it: a test that proves nothing about the behaviour).

``--in-tree`` runs the in-tree series (balance scheduling in vLLM; after the seam series where
release X has one, alone from 0.34 on) instead of the seam alone: the stack's tests are applied
to the sdist's and run with vLLM's own tests of every file they go to (a file they create
included); the unpatched side is release X as it ships, the patched side its unpacked wheel with
the stack's ``vllm/`` part applied (it changes more than the scheduler, so the whole tree is
patched, then restored). Pass as for the seam, with the stack's tests as "the series' tests";
each one's reason to fail unpatched is reported (a test of a new method fails there with an
``AttributeError``: the method is what the series adds).

``--pause-tests`` runs the tests-only PR (``pause-tests/v<X>/``): its cases are added to the
sdist's ``test_scheduler.py`` and ``test_remote_prefill_lifecycle.py``; one side runs
``scheduler.py`` as the release ships it, then one side each of its ``mutants/*.patch``
(``scheduler.py`` with one guard changed). Pass: the PR's tests pass as shipped and each mutant
fails at least one of them; reported per mutant: which of vLLM's own tests already catch it.

``--balance --vllm-ascend R`` adds a third side, vllm-ascend release R's own ``BalanceScheduler``
(its sdist's source, fetched like vLLM's; gate open), reported beside the two and not judged;
``--vllm-ascend-tree DIR`` the same for a vllm-ascend work tree (a series applied: the pause-state
PR's numbers are measured so).

``--balance`` compares this package instead of the seam: the "upstream" side runs the installed
scheduler as it is; on the "balance" side every ``Scheduler`` / ``AsyncScheduler`` the tests
build (through ``create_scheduler`` or directly; ``__new__`` returns ours, the names stay
upstream's) is ``vllm_balance.BalanceScheduler`` / ``BalanceAsyncScheduler`` with balance on
and the gate open (one DP rank, gathered count 0), i.e.
the shim on a seamed vLLM and the compat class on an unpatched one. Pass: the balance side passes
every test upstream passes, with the same skips (contract 2 on vLLM's own tests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from balance_testbed.junit import junit_failures, junit_outcomes, tally
from balance_testbed.seam_patch import (
    IN_TREE_ROOT,
    SCHEDULER_PATH,
    SEAM_METHOD,
    SEAM_TEST_PATH,
    PatchError,
    fetch_sdist,
    git_apply,
    in_tree_stack,
    installed_version,
    installed_vllm_root,
    match_series,
    mutants,
    numstat,
    pause_tests_series,
    scheduler_text,
    seam_test_names,
    shadowing,
    unpacked_release,
    wheel_scheduler_source,
)

HERE = Path(__file__).resolve().parent

ENTRY_TEST = SEAM_TEST_PATH  # vLLM's test_scheduler.py, where the series adds its cases
ASYNC_TEST = "tests/v1/core/test_async_scheduler.py"
# vLLM's own tests of both scheduler classes, for the seam and for --balance (whose side swaps
# AsyncScheduler too); reach records them together, by_file apart.
SEAM_ENTRIES = BALANCE_ENTRIES = (ENTRY_TEST, ASYNC_TEST)
# --pause-tests: the tests-only PR adds cases to test_scheduler.py and to the lifecycle tests of
# async KV loads, where vLLM tests async_kv_waiting (pause-tests/PR.md).
LIFECYCLE_TEST = "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py"
PAUSE_ENTRIES = (ENTRY_TEST, ASYNC_TEST, LIFECYCLE_TEST)

# pytest plugins of the test bed: in place of vLLM's conftest.py files, which are not extracted;
# with --vllm-conftest only the one that chooses each side's scheduler, beside vLLM's conftests.
CONFTEST_PLUGIN = "balance_testbed.vllm_own_conftest"
SIDE_PLUGIN = "balance_testbed.vllm_own_side"


class RunError(RuntimeError):
    pass


def extract_tests(sdist: Path, version: str, into: Path, conftests: bool = False) -> int:
    """vLLM's ``tests/`` from the sdist, without its ``conftest.py`` files (they import model
    runners and hub clients; ours replaces them) unless ``conftests``; returns how many files."""
    prefix = f"vllm-{version}/"
    with tarfile.open(sdist) as tar:
        members = [
            member
            for member in tar.getmembers()
            if member.isfile()
            and member.name.startswith(f"{prefix}tests/")
            and (conftests or Path(member.name).name != "conftest.py")
        ]
        for member in members:
            member.name = member.name.removeprefix(prefix)
        tar.extractall(into, members=members, filter="data")
    return len(members)


def pytest_child(
    args: list[str], cwd: Path, env: dict[str, str], junit: Path
) -> subprocess.CompletedProcess:
    """``pytest ARGS`` in a child process (``reach.py`` runs its suites so too): output captured,
    outcomes in the JUnit report ``junit`` (``balance_testbed/junit.py`` reads it)."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}",
         *args],
        cwd=cwd, env=env, capture_output=True, text=True,
    )  # fmt: skip


def run_side(
    tree: Path,
    name: str,
    scheduler_file: Path | None,
    pytest_args: list[str],
    tests: tuple[str, ...],
    extra_env: dict[str, str] | None = None,
) -> dict:
    """One pytest run of ``tests``; ``name`` "balance" swaps in this package's schedulers,
    "vllm-ascend" vllm-ascend's own ``BalanceScheduler``."""
    junit = tree / f"junit-{name}.xml"
    side_file = tree / f"side-{name}.json"
    env = dict(
        os.environ,
        VLLM_BALANCE_SIDE_FILE=str(side_file),
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.pop("VLLM_BALANCE_SCHEDULER_FILE", None)
    env["VLLM_BALANCE_SIDE"] = name
    if scheduler_file is not None:
        env["VLLM_BALANCE_SCHEDULER_FILE"] = str(scheduler_file)
    env.update(extra_env or {})
    run = pytest_child(["--rootdir", str(tree), *tests, *pytest_args], tree, env, junit)
    log = tree / f"pytest-{name}.log"
    log.write_text(run.stdout + run.stderr)
    if not junit.exists():
        raise RunError(f"{name}: pytest produced no report; see {log}")
    side = json.loads(side_file.read_text())
    return {
        "outcomes": junit_outcomes(junit),
        "failures": junit_failures(junit),
        "side": side,
        "log": str(log),
    }


def is_seam_test(test_id: str, seam_names: frozenset[str]) -> bool:
    """Whether a ``classname::name`` id is one of the series' own tests (the functions it
    adds to test_scheduler.py; a parametrized one is ``name[...]``)."""
    return test_id.split("::", 1)[-1].split("[", 1)[0] in seam_names


def failure_reason(message: str) -> str:
    """Where a failure's traceback points: its failing line and pytest's first ``E`` line."""
    lines = message.splitlines()
    at = next((ln.strip() for ln in lines if ln.startswith(">")), "")
    why = next((ln[1:].strip() for ln in lines if ln.startswith("E ")), lines[0] if lines else "")
    return f"{at} -> {why}"[:300]


def summarize(outcomes: dict[str, str], seam_names: frozenset[str], seam: bool) -> dict:
    return tally(outcomes, lambda test_id: is_seam_test(test_id, seam_names) == seam)


def by_file(
    outcomes: dict[str, str], entries: tuple[str, ...], seam_names: frozenset[str]
) -> dict[str, dict[str, int]]:
    """Counts per test file of vLLM's own tests, and the series' tests on their own."""
    counts = {}
    for entry in entries:
        module = entry.removesuffix(".py").replace("/", ".")
        in_file = {t: o for t, o in outcomes.items() if t.split("::")[0] == module}
        counts[Path(entry).name] = summarize(in_file, seam_names, False)
    if seam_names:
        counts["the series' tests"] = summarize(outcomes, seam_names, True)
    return counts


def lost_tests(
    reference: dict[str, str], candidate: dict[str, str], seam_names: frozenset[str]
) -> tuple[list, list]:
    """vLLM's tests the reference passes and the candidate does not; tests whose skip differs."""
    own = [t for t in reference if not is_seam_test(t, seam_names)]
    lost = [t for t in own if reference[t] == "passed" and candidate.get(t) != "passed"]
    skip_drift = [t for t in own if (reference[t] == "skipped") != (candidate.get(t) == "skipped")]
    return lost, skip_drift


def seam_sides(
    tree: Path, source: str, match, pytest_args: list[str], seam_names: frozenset[str]
) -> tuple[dict, list[str]]:
    """The series on vLLM's own tests: unpatched vs patched, its own tests on both (what both
    kinds of side must show, nothing lost and the same skips, ``main`` checks)."""
    applied = git_apply(tree, "--include=tests/*", *map(str, match.series.patches))
    if applied.returncode != 0:
        raise RunError(f"the series' tests do not apply to the sdist's: {applied.stderr.strip()}")
    other = tree / "scheduler_other_side.py"
    other.write_text(scheduler_text(source, match.series, reverse=match.already_seamed))
    unpatched_file, patched_file = (other, None) if match.already_seamed else (None, other)
    sides = {
        "unpatched": run_side(tree, "unpatched", unpatched_file, pytest_args, SEAM_ENTRIES),
        "patched": run_side(tree, "patched", patched_file, pytest_args, SEAM_ENTRIES),
    }
    return sides, judge_series_tests(sides, seam_names)


def in_tree_test_paths(stack: list) -> tuple[str, ...]:
    """vLLM's test files the in-tree run covers: the seam's, then every test file the stack
    changes or creates."""
    changed = (path for series in stack for path in numstat(series))
    return tuple(
        dict.fromkeys([*SEAM_ENTRIES, *(p for p in changed if Path(p).name.startswith("test_"))])
    )


def in_tree_sides(
    tree: Path,
    unpacked: Path,
    stack: list,
    pytest_args: list[str],
    seam_names: frozenset[str],
    entries: tuple[str, ...],
) -> tuple[dict, list[str]]:
    """The in-tree series on vLLM's own tests (``entries``): release as shipped vs the unpacked
    release (``unpacked``, first on the children's PYTHONPATH) with every series of ``stack``
    applied."""
    patches = [str(patch) for series in stack for patch in series.patches]
    applied = git_apply(tree, "--include=tests/*", *patches)
    if applied.returncode != 0:
        raise RunError(f"the series' tests do not apply to the sdist's: {applied.stderr.strip()}")
    sides = {"unpatched": run_side(tree, "unpatched", None, pytest_args, entries)}
    applied = git_apply(unpacked, "--include=vllm/*", *patches)
    if applied.returncode != 0:
        raise RunError(f"the series do not apply to the wheel's vllm/: {applied.stderr.strip()}")
    try:
        sides["patched"] = run_side(tree, "patched", None, pytest_args, entries)
    finally:
        git_apply(unpacked, "-R", "--include=vllm/*", *patches[::-1])
    seamed = any(series.directory.parent != IN_TREE_ROOT for series in stack)
    return sides, judge_series_tests(sides, seam_names, seamed)


def pause_tests_sides(tree: Path, source: str, series, pytest_args: list[str]) -> dict:
    """The tests-only PR: vLLM's tests with its cases added, on ``scheduler.py`` as the release
    ships it (``source``) and on each of the series' mutants of it."""
    applied = git_apply(tree, *map(str, series.patches))
    if applied.returncode != 0:
        raise RunError(f"the PR does not apply to the sdist's tests: {applied.stderr.strip()}")
    sides = {"as-shipped": run_side(tree, "as-shipped", None, pytest_args, PAUSE_ENTRIES)}
    for mutant in mutants(series):
        mutated = tree / f"scheduler-{mutant.ref}.py"
        mutated.write_text(scheduler_text(source, mutant))
        sides[mutant.ref] = run_side(tree, mutant.ref, mutated, pytest_args, PAUSE_ENTRIES)
    return sides


def judge_pause_tests(sides: dict, names: frozenset[str]) -> tuple[dict, list[str]]:
    """Per mutant, which of the PR's tests kill it and which of vLLM's own tests (passing as
    shipped) already do; problems: a PR test not passing as shipped, a mutant no PR test kills."""
    shipped = sides["as-shipped"]["outcomes"]
    new = [t for t in shipped if is_seam_test(t, names)]
    problems = [] if new else ["none of the PR's tests ran"]
    problems += [f"fails as shipped: {t}" for t in new if shipped[t] != "passed"]
    verdicts = {}
    for name, side in list(sides.items())[1:]:
        failed = [t for t, outcome in side["outcomes"].items() if outcome == "failed"]
        verdicts[name] = {
            "killed_by": [t for t in failed if t in new],
            "vllm_tests_that_catch_it": [
                t for t in failed if t not in new and shipped.get(t) == "passed"
            ],
        }
        if not verdicts[name]["killed_by"]:
            problems.append(f"mutant {name} survives every test of the PR")
    return verdicts, problems


def judge_series_tests(sides: dict, seam_names: frozenset[str], seamed: bool = True) -> list[str]:
    """Each side ran the scheduler it should (the seam on the patched side only, and there only
    if ``seamed``: a standalone in-tree series has none); the series' own tests pass patched,
    each fails unpatched, and none fails there only because the seam method is missing."""
    problems = []
    for name, result in sides.items():
        if result["side"]["has_seam"] != (seamed and name == "patched"):
            problems.append(f"{name} side ran the wrong scheduler: {result['side']}")
    unpatched, patched = sides["unpatched"]["outcomes"], sides["patched"]["outcomes"]
    seam_ids = [t for t in patched if is_seam_test(t, seam_names)]
    if len(seam_ids) < len(seam_names) or any(patched[t] != "passed" for t in seam_ids):
        problems.append(f"the series' tests do not all pass patched: {seam_ids}")
    failing = [t for t in seam_ids if unpatched.get(t) == "failed"]
    if failing != seam_ids:
        passing = [t for t in seam_ids if t not in failing]
        problems.append(f"series tests that do not fail without the series: {passing}")
    messages = sides["unpatched"]["failures"]
    missing = [t for t in failing if "AttributeError" in messages[t] and SEAM_METHOD in messages[t]]
    if missing:
        problems.append(f"series tests fail unpatched only for the missing method: {missing}")
    return problems


def balance_sides(
    tree: Path, pytest_args: list[str], ascend_root: Path | None = None
) -> tuple[dict, list[str]]:
    """This package's balance scheduler (gate open) vs the installed upstream scheduler; with
    ``ascend_root`` (a vllm-ascend release's source, ``balance_testbed.vllm_ascend_standin``) also
    vllm-ascend's own ``BalanceScheduler`` (gate open), reported beside them."""
    sides = {
        name: run_side(tree, name, None, pytest_args, BALANCE_ENTRIES)
        for name in ("upstream", "balance")
    }
    if ascend_root is not None:
        env = {"VLLM_BALANCE_ASCEND_ROOT": str(ascend_root)}
        sides["vllm-ascend"] = run_side(
            tree, "vllm-ascend", None, pytest_args, BALANCE_ENTRIES, env
        )
    problems = []
    if (
        sides["upstream"]["side"]["balance_classes"]
        or not sides["balance"]["side"]["balance_classes"]
    ):
        problems.append(f"a side ran the wrong scheduler: {[s['side'] for s in sides.values()]}")
    return sides, problems


def prepare_tree(version: str, vllm_conftest: bool, pytest_args: list[str]) -> tuple:
    """A scratch tree with the release's ``tests/`` (from its sdist) ready for pytest: returns
    the tree, how many files were extracted, which conftest serves, the full pytest arguments."""
    tree = Path(tempfile.mkdtemp(prefix=f"vllm-{version}-own-tests-"))
    extracted = extract_tests(fetch_sdist(version), version, tree, conftests=vllm_conftest)
    if vllm_conftest:
        conftest = "vLLM's own conftest.py files, VLLM_TARGET_DEVICE=cpu"
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # for the pytest children
        pytest_args = ["-p", SIDE_PLUGIN, *pytest_args]
    else:
        conftest = f"{CONFTEST_PLUGIN} (this repository's offline replacement)"
        pytest_args = ["-p", CONFTEST_PLUGIN, *pytest_args]
    # pytest's defaults, not the settings of a directory above the tree: nox puts it under this
    # repository (its --strict-markers refuses 0.30.0's test_scheduler.py, whose markers are
    # registered by vLLM's own configuration, which is not extracted).
    (tree / "pytest.ini").write_text("[pytest]\n")
    return tree, extracted, conftest, pytest_args


def pause_tests_main(args, version: str, source: str) -> int:
    """``--pause-tests``: the tests-only PR on release ``version`` (``source``: scheduler.py)."""
    series = pause_tests_series(version)
    if series is None:
        print(f"run_vllm_tests.py: error: no tests-only PR for vLLM {version}", file=sys.stderr)
        return 1
    names = frozenset(seam_test_names(series, (ENTRY_TEST, LIFECYCLE_TEST)))
    tree, extracted, conftest, pytest_args = prepare_tree(
        version, args.vllm_conftest, list(args.pytest_args)
    )
    sides = pause_tests_sides(tree, source, series, pytest_args)
    verdicts, problems = judge_pause_tests(sides, names)
    print(f"vLLM {version}: conftest: {conftest}; tests-only PR {series.ref}")
    for name, side in sides.items():
        for label, counts in by_file(side["outcomes"], PAUSE_ENTRIES, names).items():
            tallied = ", ".join(f"{v} {k}" for k, v in counts.items())
            print(f"vLLM {version} {name}: {label}: {tallied}")
    for name, verdict in verdicts.items():
        caught = [t.split("::")[-1] for t in verdict["vllm_tests_that_catch_it"]]
        print(f"mutant {name}: killed by {[t.split('::')[-1] for t in verdict['killed_by']]}")
        print(f"mutant {name}: vLLM's own tests that catch it: {caught or 'none'}")
    if args.report:
        report = {
            "vllm": version,
            "conftest": conftest,
            "series": series.ref,
            "extracted_files": extracted,
            "by_file": {n: by_file(s["outcomes"], PAUSE_ENTRIES, names) for n, s in sides.items()},
            "mutants": verdicts,
            "logs": {n: s["log"] for n, s in sides.items()},
            "problems": problems,
        }
        args.report.write_text(json.dumps(report, indent=2))
    for problem in problems:
        print(f"run_vllm_tests.py: FAIL: {problem}", file=sys.stderr)
    if not problems:
        shutil.rmtree(tree, ignore_errors=True)  # on failure the tree and its logs stay
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="write the result as JSON here")
    parser.add_argument(
        "--balance", action="store_true", help="this package's scheduler vs upstream (no seam)"
    )
    parser.add_argument("--release", help="a vLLM release to run on instead of the installed one")
    parser.add_argument(
        "--in-tree", action="store_true", help="the in-tree series (needs --release)"
    )
    parser.add_argument(
        "--vllm-ascend",
        metavar="RELEASE",
        help="with --balance: also vllm-ascend RELEASE's own BalanceScheduler (its sdist's source)",
    )
    parser.add_argument(
        "--vllm-ascend-tree",
        metavar="DIR",
        type=Path,
        help="with --balance: also the BalanceScheduler of a vllm-ascend work tree as it is now",
    )
    parser.add_argument(
        "--pause-tests",
        action="store_true",
        help="the tests-only PR (pause-tests/): as shipped and on each of its mutants",
    )
    parser.add_argument(
        "--vllm-conftest",
        action="store_true",
        help="keep vLLM's own conftest.py files (VLLM_TARGET_DEVICE=cpu; needs the hub's models)",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.in_tree and (args.balance or not args.release):
        parser.error("--in-tree needs --release and excludes --balance")

    if args.release:
        version = args.release
        wheel, unpacked = unpacked_release(version)
        source = wheel_scheduler_source(wheel)
        os.environ.update(shadowing(unpacked))  # for the pytest children
    else:
        version = installed_version()
        source = (installed_vllm_root() / SCHEDULER_PATH).read_text(encoding="utf-8")
    if args.pause_tests:
        try:
            return pause_tests_main(args, version, source)
        finally:
            if args.release:
                shutil.rmtree(unpacked, ignore_errors=True)
    match = None
    try:
        match = match_series(source, version)
    except PatchError as exc:
        if not (args.balance or args.in_tree):  # neither needs one: it may be past the seam
            print(f"run_vllm_tests.py: error: {exc}", file=sys.stderr)
            return 1
    entries = BALANCE_ENTRIES if args.balance else SEAM_ENTRIES
    # --balance runs vLLM's tests as the sdist has them: the series' tests are not in the tree.
    stack = in_tree_stack(version) if args.in_tree else [] if match is None else [match.series]
    if args.in_tree and not stack:
        print(f"run_vllm_tests.py: error: no in-tree series for vLLM {version}", file=sys.stderr)
        return 1
    if args.in_tree:
        entries = in_tree_test_paths(stack)
    names = {name for series in stack for name in seam_test_names(series, entries)}
    seam_names = frozenset() if args.balance else frozenset(names)
    tree, extracted, conftest, pytest_args = prepare_tree(
        version, args.vllm_conftest, list(args.pytest_args)
    )
    if args.balance:
        ascend_root = None
        if args.vllm_ascend:
            from balance_testbed.vllm_ascend_standin import prepared_root

            ascend_root = prepared_root(args.vllm_ascend, version)
        elif args.vllm_ascend_tree:
            from balance_testbed.vllm_ascend_standin import root_from_tree

            ascend_root = root_from_tree(args.vllm_ascend_tree.resolve())
        try:
            sides, problems = balance_sides(tree, pytest_args, ascend_root)
        finally:
            if args.vllm_ascend_tree and ascend_root is not None:
                shutil.rmtree(ascend_root, ignore_errors=True)  # a copy made for this run only
    elif args.in_tree:
        sides, problems = in_tree_sides(tree, unpacked, stack, pytest_args, seam_names, entries)
    else:
        sides, problems = seam_sides(tree, source, match, pytest_args, seam_names)
    reference, candidate = list(sides)[:2]
    lost, skip_drift = lost_tests(
        sides[reference]["outcomes"], sides[candidate]["outcomes"], seam_names
    )
    # Reported, not a problem of this package: what vllm-ascend's copy loses against upstream.
    also_lost = {
        name: lost_tests(sides[reference]["outcomes"], side["outcomes"], seam_names)[0]
        for name, side in list(sides.items())[2:]
    }
    if lost:
        problems.append(f"{candidate} side fails {len(lost)} test(s) upstream passes: {lost[:5]}")
    if skip_drift:
        problems.append(f"skips differ between sides: {skip_drift[:5]}")
    report = {
        "vllm": version,
        "conftest": conftest,
        "series": match.series.ref if match else None,
        "stack": [str(series.directory.relative_to(HERE)) for series in stack],
        "installed_is_patched": bool(match and match.already_seamed),
        "extracted_files": extracted,
        # vLLM's own tests (all entry files together; the name is what reach.py reads).
        "test_scheduler": {
            n: summarize(s["outcomes"], seam_names, False) for n, s in sides.items()
        },
        "seam_tests": {n: summarize(s["outcomes"], seam_names, True) for n, s in sides.items()},
        "by_file": {n: by_file(s["outcomes"], entries, seam_names) for n, s in sides.items()},
        "logs": {n: s["log"] for n, s in sides.items()},
        "lost": lost,  # vLLM's own tests the reference side passes and the other does not
        "lost_by": also_lost,  # the same for a side beside them (vllm-ascend's scheduler)
        "problems": problems,
    }
    # Why each of the series' tests fails where it does (the unpatched side): its stated reason.
    report["seam_failures"] = {
        name: {
            test_id: failure_reason(message)
            for test_id, message in side["failures"].items()
            if is_seam_test(test_id, seam_names)
        }
        for name, side in sides.items()
    }
    print(f"vLLM {version}: conftest: {conftest}")
    for name in sides:
        for test_id, reason in report["seam_failures"][name].items():
            print(f"vLLM {version} {name:9s} {test_id.split('::')[-1]} fails: {reason}")
        for label, counts in report["by_file"][name].items():
            print(
                f"vLLM {version} {name:9s} {label}: "
                + ", ".join(f"{v} {k}" for k, v in counts.items())
            )
    for name, lost_there in also_lost.items():
        print(f"vLLM {version} {name} fails {len(lost_there)} test(s) upstream passes:")
        for test_id in lost_there:
            print(f"  {test_id}")
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))
    for problem in problems:
        print(f"run_vllm_tests.py: FAIL: {problem}", file=sys.stderr)
    if args.release:
        shutil.rmtree(unpacked, ignore_errors=True)
    if not problems:
        shutil.rmtree(tree, ignore_errors=True)  # on failure the tree and its logs stay
    if problems:
        print(f"FAILED ({len(problems)} problem(s)); logs: {report['logs']}")
    else:
        print(f"OK: the {candidate} scheduler passes every test the {reference} one passes")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
