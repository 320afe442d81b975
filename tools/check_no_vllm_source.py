#!/usr/bin/env python3
"""Find vLLM source text pasted into this repository.

The compat path derives upstream's ``schedule()`` at import time; it must never be pasted. This
compares every ``.py`` file of the repo (outside ``upstream_patch/``, whose patch context is our
authored change, and build/venv folders) with ``vllm/v1/core/sched/scheduler.py`` and
``vllm/v1/engine/core.py`` of an installed vLLM, and reports runs of >= N consecutive code lines
(whitespace-normalised, comments and short lines ignored) that the two share.

usage: check_no_vllm_source.py [REPO] [--vllm DIR] [--lines N]   (exit 1 when a run is found)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

UPSTREAM_FILES = ("v1/core/sched/scheduler.py", "v1/engine/core.py")
SKIPPED_DIRS = {".git", ".nox", "upstream_patch", "node_modules", ".venv", "build", "dist"}


def code_lines(path: Path) -> list[tuple[str, int]]:
    lines = []
    for number, raw in enumerate(
        path.read_text(encoding="utf-8", errors="replace").splitlines(), 1
    ):
        text = " ".join(raw.split())
        if len(text) > 12 and not text.startswith("#"):
            lines.append((text, number))
    return lines


def repo_files(repo: Path):
    for path in sorted(repo.rglob("*.py")):
        if not SKIPPED_DIRS.intersection(path.relative_to(repo).parts):
            yield path


def shared_runs(repo: Path, vllm_dir: Path, run_length: int = 6) -> list[str] | None:
    """``path:line shares N+ lines with vllm/<file>:<line>`` per run; None without a vLLM."""
    if not (vllm_dir / UPSTREAM_FILES[0]).exists():
        return None
    windows: dict[tuple[str, ...], str] = {}
    for rel in UPSTREAM_FILES:
        lines = code_lines(vllm_dir / rel)
        for i in range(len(lines) - run_length + 1):
            key = tuple(text for text, _ in lines[i : i + run_length])
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
