"""Write vllm-ascend's BalanceScheduler.schedule() anew from the installed vLLM (Phase 2A).

    python upstream_patch/vllm-ascend/phase2a.py <vllm-ascend work tree> [--check] [--commit]

vllm-ascend's ``patch_balance_schedule.py`` keeps a copy of vLLM's ``Scheduler.schedule()`` with
three balance deltas: (1) ``if not self._balance_enabled: return super().schedule(...)`` first,
(2) ``if max(t.item() for t in self.balance_queue) == self.max_num_running_reqs: break`` after
upstream's slot check in the WAITING loop, (3) ``if request_queue is None: break`` for upstream's
``assert request_queue is not None``. This writes that method as the installed vLLM's own
``schedule()`` with exactly those deltas, derived by the package's compat derivation
(``vllm_balance.compat.derive.derive_source`` with vllm-ascend's ``Deltas``: same anchors, same
checks, same splicing), into the work tree; the rest of the file stays vllm-ascend's. Names the
new method uses that the module does not bind are imported as vLLM's scheduler module imports
them; ``ruff`` (vllm-ascend's formatter and linter, its own configuration) then formats the file
and drops imports the old copy needed and the new one does not, where ``ruff`` is on PATH.

The generated text is vLLM's: it is written into vllm-ascend's tree, never into this
repository. ``--check`` exits 1 when the tree's copy is not what this would write (what
vllm-ascend's refreshed drift test checks in its CI, from the installed vLLM alone).
``--commit`` commits the file in the tree as whoever runs it.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

from vllm_balance.compat.derive import (
    DELTA_DISABLED_PATH,
    DELTA_NO_QUEUE,
    SCHEDULER_MODULE,
    Deltas,
    derive_source,
    find_schedule,
)

BALANCE_MODULE = "vllm_ascend/patch/platform/patch_balance_schedule.py"
CLASS_NAME = "BalanceScheduler"
# vllm-ascend's gate (delta 2), as its copy has had it since the refactor.
VLLM_ASCEND_GATE = (
    "# Balance delta 2 (gate): a DP rank at the running cap after the previous step stops",
    "# admission of WAITING requests on every rank this step.",
    "if max(t.item() for t in self.balance_queue) == self.max_num_running_reqs:",
    "    break",
)
VLLM_ASCEND_DELTAS = Deltas(gate=VLLM_ASCEND_GATE)
# The module docstring's statement of what the copy is aligned to.
ALIGNED_TO = re.compile(r"verbatim copy of the \*\*v?[0-9][^*]*\*\* release tag's")
# The deltas as the module docstring names them (the three lines the drift test strips).
DELTAS_TEXT = (DELTA_DISABLED_PATH[1], VLLM_ASCEND_GATE[2], DELTA_NO_QUEUE[1])


class GenerateError(RuntimeError):
    pass


def installed_scheduler() -> tuple[str, str, str]:
    """(source, path, version) of the installed vLLM's scheduler module, not imported."""
    from importlib.metadata import version

    spec = importlib.util.find_spec(SCHEDULER_MODULE)
    if spec is None or spec.origin is None:
        raise GenerateError(f"{SCHEDULER_MODULE} is not installed")
    return Path(spec.origin).read_text(encoding="utf-8"), spec.origin, version("vllm")


def _bound_names(nodes: list[ast.stmt]) -> set[str]:
    """Names a module binds at its top level (imports, assignments, defs), ``if`` blocks too."""
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):
            names |= _bound_names(node.body + node.orelse)
    return names


def _is_vllm_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "vllm"
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names)


def free_names(fn: ast.FunctionDef) -> set[str]:
    """Global names ``fn`` reads: loaded, never bound in it, not builtins."""
    loaded, bound = set(), {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return loaded - bound - set(dir(builtins))


def import_lines(names: set[str], vllm_module: ast.Module) -> list[str]:
    """``from X import name`` for each name, as vLLM's scheduler module binds it (its own
    definitions from the module itself)."""
    lines = []
    for name in sorted(names):
        found = None
        for node in ast.walk(vllm_module):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = f"from {node.module} import {alias.name}" + (
                            f" as {alias.asname}" if alias.asname else ""
                        )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if (alias.asname or alias.name.split(".")[0]) == name:
                        found = f"import {alias.name}" + (
                            f" as {alias.asname}" if alias.asname else ""
                        )
        if found is None and name in _bound_names(vllm_module.body):
            found = f"from {SCHEDULER_MODULE} import {name}"
        if found is None:
            raise GenerateError(
                f"schedule() reads {name!r}, which vLLM's scheduler module does not bind"
            )
        lines.append(found + "\n")
    return lines


def refreshed_module(ascend_text: str, vllm_source: str, vllm_version: str, origin: str) -> str:
    """vllm-ascend's module with ``BalanceScheduler.schedule`` the derived method."""
    derived = derive_source(vllm_source, vllm_version, origin, VLLM_ASCEND_DELTAS)
    tree = ast.parse(ascend_text)
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS_NAME]
    if len(classes) != 1:
        raise GenerateError(f"{BALANCE_MODULE} has {len(classes)} classes {CLASS_NAME}")
    methods = [
        n for n in classes[0].body if isinstance(n, ast.FunctionDef) and n.name == "schedule"
    ]
    if len(methods) != 1:
        raise GenerateError(f"{CLASS_NAME} has {len(methods)} schedule() methods")
    old = methods[0]
    lines = ascend_text.splitlines(keepends=True)
    start = min([old.lineno] + [d.lineno for d in old.decorator_list]) - 1
    lines[start : old.end_lineno] = [derived.method]
    new_fn = find_schedule(ast.parse(vllm_source), vllm_version)
    missing = free_names(new_fn) - _bound_names(tree.body)
    if missing:  # above the class: inserting there moves nothing the splice used
        at = max(n.end_lineno or n.lineno for n in tree.body if _is_vllm_import(n))
        assert at <= start, "vLLM imports after the class"
        lines[at:at] = import_lines(missing, ast.parse(vllm_source))
    text = "".join(lines)
    text, count = ALIGNED_TO.subn(f"verbatim copy of the **v{vllm_version}** release tag's", text)
    if count != 1:
        raise GenerateError(f"{BALANCE_MODULE}'s docstring does not say which release it copies")
    return text


def ruff_fix(path: Path, tree: Path) -> bool:
    """vllm-ascend's own ruff configuration on the file: unused imports out, then formatted."""
    ruff = shutil.which("ruff")
    if ruff is None:
        return False
    for args in (["check", "--fix", "--select", "F401,I", "--quiet"], ["format", "--quiet"]):
        subprocess.run([ruff, *args, str(path)], cwd=tree, check=True)
    return True


def generate(tree: Path) -> tuple[str, str]:
    """(the refreshed module text, the vLLM version); formatted when ruff is on PATH."""
    vllm_source, origin, version = installed_scheduler()
    target = tree / BALANCE_MODULE
    text = refreshed_module(target.read_text(encoding="utf-8"), vllm_source, version, origin)
    scratch = tree / (BALANCE_MODULE + ".phase2a.py")
    scratch.write_text(text, encoding="utf-8")
    try:
        ruff_fix(scratch, tree)
        return scratch.read_text(encoding="utf-8"), version
    finally:
        scratch.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, help="a vllm-ascend work tree")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the copy is not current")
    mode.add_argument("--commit", action="store_true", help="commit the refreshed file there")
    args = parser.parse_args()
    tree = args.tree.resolve()
    try:
        text, version = generate(tree)
    except GenerateError as exc:
        print(f"phase2a.py: error: {exc}", file=sys.stderr)
        return 2
    target = tree / BALANCE_MODULE
    if args.check:
        current = target.read_text(encoding="utf-8") == text
        print(f"{BALANCE_MODULE}: {'current' if current else 'NOT current'} for vLLM {version}")
        return 0 if current else 1
    target.write_text(text, encoding="utf-8")
    print(f"{BALANCE_MODULE}: BalanceScheduler.schedule() is vLLM {version}'s plus the 3 deltas")
    if shutil.which("ruff") is None:
        print("ruff not on PATH: run vllm-ascend's pre-commit (ruff) on the file before committing")
    if args.commit:
        message = (
            f"[BugFix][Core] Align BalanceScheduler.schedule() with vLLM v{version}\n\n"
            f"Regenerated from vLLM v{version}'s Scheduler.schedule() with exactly the three\n"
            "balance deltas (disabled-path return, the balance_queue gate, no waiting queue\n"
            "ends admission) by vllm-balance-scheduling's upstream_patch/vllm-ascend/phase2a.py.\n"
        )
        subprocess.run(["git", "-C", str(tree), "add", BALANCE_MODULE], check=True)
        subprocess.run(["git", "-C", str(tree), "commit", "-q", "-m", message], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
