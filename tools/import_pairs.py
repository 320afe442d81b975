#!/usr/bin/env python3
"""Which top-level folder imports which: every import of the repository's Python files, resolved
to the folder that defines the module, counted per ordered pair of folders.

    python tools/import_pairs.py            # the table
    python tools/import_pairs.py --check    # exit 1: a pair both ways, an import up, a bare name

Support code imports one way (product <- simulator <- test bed <- tools, upstream_patch,
benchmarks <- tests), each by an explicit import name (``balance_testbed.pins``,
``tools.support_matrix``). A *bare*
name is a module of another folder imported as if it were a neighbour (``import pins`` from
tests/): it works only with that folder on the path. A script's own folder is on its path, so a
bare name of the importing file's own folder is a neighbour, not a crossing.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each top-level folder's layer: an import may go to a lower layer, or across within one, never up.
LAYERS = {
    **dict.fromkeys(("vllm_balance", "shim", "compat"), 0),  # the product
    "balance_sim": 1,  # drives the product; ships beside it in the wheel
    "testbed": 2,
    **dict.fromkeys(("tools", "upstream_patch", "benchmarks"), 3),
    "tests": 4,
}
FOLDERS = tuple(LAYERS)
# Installed import names and the folder that holds them.
PACKAGES = {
    "vllm_balance": "vllm_balance",
    "balance_sim": "balance_sim",
    "balance_testbed": "testbed",
    "vllm_balance_e2e_plugins": "testbed",
    **{name: name for name in ("tests", "tools", "upstream_patch", "benchmarks")},
}


STAND_IN = Path("testbed") / "ascend_standin"  # torch_npu's stand-in, not a module of the tree


def python_files(root: Path, folder: str) -> list[Path]:
    return sorted(p for p in (root / folder).rglob("*.py") if ".nox" not in p.parts)


def bare_names(root: Path) -> dict[str, str]:
    """Module name -> folder, for every module of a folder importable by its bare name (a file or
    a package directly in the folder or in one of its subfolders)."""
    names: dict[str, str] = {}
    for folder in FOLDERS:
        for path in python_files(root, folder):
            if root / STAND_IN in path.parents:
                continue  # the real torch_npu is what a test imports where it is installed
            name = path.parent.name if path.name == "__init__.py" else path.stem
            names.setdefault(name, folder)
    return names


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
    return modules


def crossings(root: Path = ROOT) -> tuple[Counter, list[str]]:
    """(imports per ordered folder pair, one line per bare cross-folder name)."""
    bare = bare_names(root)
    pairs: Counter = Counter()
    bare_lines = []
    for folder in FOLDERS:
        for path in python_files(root, folder):
            neighbours = {p.stem for p in path.parent.glob("*.py")} | {
                p.name for p in path.parent.iterdir() if (p / "__init__.py").exists()
            }
            for module in imported_modules(path):
                head = module.split(".")[0]
                target = PACKAGES.get(head)
                if target is None and head not in neighbours and head in bare:
                    target = bare[head]
                    if target != folder:  # a neighbour of a subfolder: the same folder
                        bare_lines.append(f"{path.relative_to(root)}: {module} ({target}/)")
                if target is not None and target != folder:
                    pairs[folder, target] += 1
    return pairs, bare_lines


def both_ways(pairs: Counter) -> list[tuple[str, str]]:
    return sorted({tuple(sorted(pair)) for pair in pairs if pair[::-1] in pairs})


def upward(pairs: Counter) -> list[tuple[str, str]]:
    return sorted(pair for pair in pairs if LAYERS[pair[1]] > LAYERS[pair[0]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on any of the three")
    args = parser.parse_args(argv)
    pairs, bare_lines = crossings()
    for (source, target), count in sorted(pairs.items()):
        back = pairs.get((target, source), 0)
        print(f"{source} -> {target}: {count}" + (f"  (and back: {back})" if back else ""))
    for line in bare_lines:
        print(f"bare: {line}")
    two_way, up = both_ways(pairs), upward(pairs)
    for first, second in two_way:
        print(f"both ways: {first} <-> {second}")
    for source, target in up:
        print(f"upward: {source} -> {target}")
    return 1 if args.check and (two_way or up or bare_lines) else 0


if __name__ == "__main__":
    sys.exit(main())
