#!/usr/bin/env python3
"""Find vLLM source text pasted into this repository.

The compat path derives upstream's ``schedule()`` at import time; it must never be pasted. This
compares every source and text file of the repo (``.py .md .txt .toml .json``; build and venv
folders aside) with ``vllm/v1/core/sched/scheduler.py`` and ``vllm/v1/engine/core.py`` of an
installed vLLM, and reports runs of >= N consecutive code lines (whitespace-normalised, comments
and short lines ignored) that the two share. The seam series (``upstream_patch/v*/*.patch``) and
```diff`` blocks in Markdown (the PR description quotes the patch) may show vLLM's lines as diff
context: they are not read.

usage: check_no_vllm_source.py [REPO] [--vllm DIR] [--lines N]   (exit 1 when a run is found)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

UPSTREAM_FILES = ("v1/core/sched/scheduler.py", "v1/engine/core.py")
SUFFIXES = {".py", ".md", ".txt", ".toml", ".json"}
SKIPPED_DIRS = {".git", ".nox", "node_modules", ".venv", "build", "dist", "__pycache__"}
DIFF_BLOCK = re.compile(r"^```diff\n.*?^```", re.M | re.S)


def code_lines(path: Path) -> list[tuple[str, int]]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".md":  # blank out diff blocks, keeping the line numbers
        text = DIFF_BLOCK.sub(lambda block: "\n" * block.group().count("\n"), text)
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = " ".join(raw.split())
        if len(line) > 12 and not line.startswith("#"):
            lines.append((line, number))
    return lines


def repo_files(repo: Path):
    for folder, dirs, files in os.walk(repo):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in sorted(files):
            if Path(name).suffix in SUFFIXES:
                yield Path(folder) / name


def shared_runs(repo: Path, vllm_dir: Path, run_length: int = 6) -> list[str] | None:
    """``path:line shares N+ lines with vllm/<file>:<line>`` per run; None without a vLLM."""
    if not (vllm_dir / UPSTREAM_FILES[0]).exists():
        return None
    # A vLLM with the seam applied carries our own lines (the series' "+" lines): not vLLM's.
    authored = {
        " ".join(line[1:].split())
        for patch in repo.glob("upstream_patch/v[0-9]*/*.patch")
        for line in patch.read_text(encoding="utf-8").splitlines()
        if line.startswith("+")
    }
    windows: dict[tuple[str, ...], str] = {}
    for rel in UPSTREAM_FILES:
        lines = code_lines(vllm_dir / rel)
        for i in range(len(lines) - run_length + 1):
            key = tuple(text for text, _ in lines[i : i + run_length])
            if not authored.intersection(key):
                windows.setdefault(key, f"vllm/{rel}:{lines[i][1]}")
    found = []
    for path in repo_files(repo):
        lines = code_lines(path)
        i = 0
        while i <= len(lines) - run_length:
            key = tuple(text for text, _ in lines[i : i + run_length])
            if key in windows:
                found.append(
                    f"{path.relative_to(repo)}:{lines[i][1]} shares {run_length}+ lines "
                    f"with {windows[key]}"
                )
                i += run_length
            else:
                i += 1
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("repo", nargs="?", default=".")
    parser.add_argument("--vllm", help="the installed vllm package directory")
    parser.add_argument("--lines", type=int, default=6)
    args = parser.parse_args()
    if args.vllm:
        vllm_dir = Path(args.vllm)
    else:
        import vllm

        vllm_dir = Path(vllm.__file__).parent
    found = shared_runs(Path(args.repo).resolve(), vllm_dir, args.lines)
    if found is None:
        print(f"no vLLM source under {vllm_dir}")
        return 2
    print("\n".join(found + [f"{len(found)} shared run(s) with vLLM source ({vllm_dir})"]))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
