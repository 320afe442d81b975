"""Run vllm-ascend's own unit tests (``tests/ut/...``) of a work tree on CPU, one process per file.

    python upstream_patch/vllm-ascend/run_ut.py <vllm-ascend work tree> [FILE ...] [--report F]

With no FILE, the files the series here touch or depend on (``UT_FILES``). Each file runs in its
own ``pytest --noconftest`` process from the tree's root, with ``testbed/ascend_standin/`` (a
``torch_npu`` stand-in) on the path and a generated ``vllm_ascend/_build_info.py`` (vllm-ascend's
build writes it; it is in vllm-ascend's .gitignore). ``--noconftest``: vllm-ascend's UT conftest
imports a multimodal model chain that needs ``torchvision``, which has no CPU build for the torch
here; a file that cannot be collected without it is reported as such, not hidden.

Prints one line per file (passed / failed / skipped / errors) and the total; exit 1 if any test
failed or errored. This is how the counts in the PR texts were taken, before and after a series.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from balance_testbed.vllm_ascend_standin import STUBS_ROOT as STANDIN

BUILD_INFO = "vllm_ascend/_build_info.py"
UT_FILES = (
    "tests/ut/patch/platform/test_patch_balance_schedule.py",
    "tests/ut/patch/platform/test_patch_engine_core.py",
    "tests/ut/patch/platform/test_patch_dyntra_lb_core.py",
    "tests/ut/core/test_short_request_first_scheduler_install.py",
    "tests/ut/observability/test_ms_metrics_provider.py",
    "tests/ut/test_profiling_config.py",
    "tests/ut/core/test_scheduler_connector_block_state.py",
)


def write_build_info(tree: Path) -> None:
    build_info = tree / BUILD_INFO
    if not build_info.exists():
        build_info.write_text('__device_type__ = "A2"\n')


def run_file(tree: Path, path: str, *pytest_args: str, env: dict | None = None) -> dict:
    """pytest on one file of ``tree`` in a child process: its outcome counts (``tally``)."""
    from balance_testbed.junit import junit_outcomes, tally

    with tempfile.TemporaryDirectory() as scratch:
        junit = Path(scratch) / "junit.xml"
        # The tree and the stand-in first; a shadowing vLLM release (seam_patch.shadowing) after.
        paths = [str(tree), str(STANDIN), (env or os.environ).get("PYTHONPATH", "")]
        child_env = dict(env or os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "-q",
             f"--junitxml={junit}", path, *pytest_args],
            cwd=tree, env=child_env, capture_output=True, text=True,
        )  # fmt: skip
        if not junit.exists():
            return {"error": (run.stdout + run.stderr)[-2000:]}
        counts = tally(junit_outcomes(junit), lambda _: True)
        if run.returncode not in (0, 1):  # collection error, no test ran
            counts["collection"] = (run.stdout + run.stderr)[-600:]
        return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path)
    parser.add_argument("files", nargs="*", default=list(UT_FILES))
    parser.add_argument("--report", type=Path, help="write the counts as JSON here")
    args = parser.parse_args()
    tree = args.tree.resolve()
    write_build_info(tree)
    results = {}
    for path in args.files:
        if not (tree / path).exists():
            results[path] = {"absent": True}
            print(f"{path}: not in this tree")
            continue
        results[path] = counts = run_file(tree, path)
        shown = {k: v for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool)}
        print(f"{path}: {shown or counts}")
    total: dict[str, int] = {}
    for counts in results.values():
        for key, value in counts.items():
            if isinstance(value, int) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    print(f"total: {total}")
    if args.report:
        args.report.write_text(json.dumps({"files": results, "total": total}, indent=2))
    return 1 if total.get("failed") or total.get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
