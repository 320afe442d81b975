#!/usr/bin/env python3
"""Negative control for the lint's mypy hook: a wrong call injected into shim/ and compat/ fails it.

shim/ and compat/ are imported as ``vllm_balance.shim`` / ``vllm_balance.compat``. mypy follows
folders, not setuptools' ``package-dir``: under such a mapping every one of those imports was
``Any`` and a wrong-arity call inside shim/ passed the hook. The folders are now reached through
the links ``vllm_balance/shim`` and ``vllm_balance/compat``. This copies the product (links kept)
into a scratch git repository, appends one wrong-arity call to a module of each folder, runs the
hook itself (``pre-commit run mypy``, its pinned mypy and entry) and exits 1 unless both calls are
reported. Run by ``nox -s lint`` after the hook passed on the real tree.

usage: mypy_control.py
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = (".pre-commit-config.yaml", "pyproject.toml", "vllm_balance", "shim", "compat")
# A call mypy rejects only if it sees the class behind the import (record_gather takes one list).
WRONG_CALL = """

def _mypy_control() -> None:
    from vllm_balance.shim.stats import BalanceStats

    BalanceStats().record_gather(1, 2, 3)
"""
BROKEN = ("shim/gather.py", "compat/pause_state.py")
EXPECTED = 'Too many arguments for "record_gather"'


def broken_copy(target: Path) -> None:
    for name in COPIED:
        source = ROOT / name
        if source.is_dir() and not source.is_symlink():
            ignore = shutil.ignore_patterns("__pycache__", ".mypy_cache")
            shutil.copytree(source, target / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(source, target / name, follow_symlinks=False)
    for name in BROKEN:
        with open(target / name, "a", encoding="utf-8") as module:
            module.write(WRONG_CALL)


def run_hook(tree: Path) -> subprocess.CompletedProcess[str]:
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tree, check=True, capture_output=True)

    git("init", "-q")
    git("add", "-A")
    return subprocess.run(
        ["pre-commit", "run", "mypy", "--all-files"], cwd=tree, capture_output=True, text=True
    )


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch)
        broken_copy(tree)
        result = run_hook(tree)
    lines = result.stdout.splitlines()
    missed = [
        name
        for name in BROKEN
        if not any(line.startswith(f"vllm_balance/{name}:") and EXPECTED in line for line in lines)
    ]
    if missed:
        print(f"mypy control: the hook missed the wrong call in {', '.join(missed)}")
        print(result.stdout[-3000:], result.stderr[-2000:])
        return 1
    print(f"mypy control: the hook reports the wrong call in {', '.join(BROKEN)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
