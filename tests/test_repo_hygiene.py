"""Repository rules that keep the project honest; each test names the rule it keeps."""

from __future__ import annotations

import ast
import graphlib
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def code_lines(path: Path) -> int:
    """Lines of code: no blanks, comments or docstrings."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    ci_lines = [ln for ln in (ROOT / ".ci/run").read_text().splitlines() if ln and ln[0] != "#"]
    command = ci_lines[-1]
    assert f"```bash\n{command}\n```" in readme


def test_mypy_hook_runs_as_one_process_over_both_packages():
    """Why: the comment above the hook in .pre-commit-config.yaml."""
    import yaml  # PyYAML: in requirements/test-cpu.txt (a vLLM dependency)

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}
    mypy = hooks["mypy"]
    assert mypy.get("require_serial") is True and mypy.get("pass_filenames") is False
    assert mypy["entry"].split()[-2:] == ["shim", "compat"]


def test_support_matrix_doc_is_current():
    """tools/support_matrix.py promises that every test session checks docs/support-matrix.md."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "support_matrix.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout


def test_shim_scheduler_stays_small():
    assert code_lines(ROOT / "shim" / "scheduler.py") <= 100


def test_shim_never_mentions_compat():
    """shim/ is what stays when compat/ is deleted: nothing in it may know compat exists."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "shim").rglob("*.py")
        if re.search(r"\bcompat\b", path.read_text(), re.IGNORECASE)
    ]
    assert offenders == []


def test_vllm_versions_are_written_only_in_pin_files():
    version = re.compile(r"""["'](v?0\.2[4-9]\.\d+|v?0\.3\d\.\d+)["']""")
    offenders = []
    for folder in ("vllm_balance", "shim", "compat", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if version.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_no_vllm_source_text_outside_the_series():
    """Shared runs of >= 6 code lines with the installed vLLM's scheduler.py / core.py, anywhere
    but the seam series and diff blocks in docs."""
    import vllm
    from check_no_vllm_source import shared_runs

    vllm_dir = Path(vllm.__file__).parent
    found = shared_runs(ROOT, vllm_dir)
    if found is None:
        pytest.fail("tools/check_no_vllm_source.py could not read the installed vLLM")
    assert found == []


def test_no_vllm_source_check_finds_pasted_lines_but_not_a_quoted_diff(tmp_path):
    """Negative control for the check above: six of the scheduler's lines pasted into a doc are
    found; the same lines as context in a ```diff block (how the PR description quotes the seam)
    are not."""
    import vllm
    from check_no_vllm_source import code_lines, shared_runs

    vllm_dir = Path(vllm.__file__).parent
    scheduler = vllm_dir / "v1/core/sched/scheduler.py"
    pasted = [text for text, _ in code_lines(scheduler)[200:206]]
    (tmp_path / "pasted.md").write_text("\n".join(["# Notes", *pasted, ""]))
    (tmp_path / "quoted.md").write_text("\n".join(["```diff", *pasted, "```", ""]))

    found = shared_runs(tmp_path, vllm_dir)

    assert [line.split(":")[0] for line in found] == ["pasted.md"]


MD_CITATION = re.compile(r"[A-Za-z0-9_./-]+\.md\b")


def cited_documents(path: Path) -> set[str]:
    """Markdown files named in a module's comments and docstrings (not in its code)."""
    source = path.read_text()
    text = [
        t.string
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text.append(ast.get_docstring(node) or "")
    return set(MD_CITATION.findall("\n".join(text)))


def uncited_documents(folder: Path, root: Path) -> list[str]:
    """``path: name`` for each document cited under ``folder`` that ``root`` does not hold."""
    present = {p.relative_to(root).as_posix() for p in root.rglob("*.md") if ".nox" not in p.parts}
    names = {p.rsplit("/", 1)[-1] for p in present}
    return sorted(
        f"{path.relative_to(folder)}: {name}"
        for path in folder.rglob("*.py")
        for name in cited_documents(path)
        if name not in present and name.rsplit("/", 1)[-1] not in names
    )


def test_tests_cite_only_documents_in_this_repository():
    """A rule a test keeps is explained where a reader of this repository can open it."""
    assert uncited_documents(ROOT / "tests", ROOT) == []


def test_citation_check_finds_a_document_outside_the_repository(tmp_path):
    """Negative control: a docstring citing a document the tree lacks is found; one citing a
    document the tree holds, and a .md name in code (a file a test writes), are not."""
    (tmp_path / "design.md").write_text("# Design\n")
    (tmp_path / "test_x.py").write_text(
        '"""Rules from STYLE.md and design.md."""\nNAME = "pasted.md"  # see design.md\n'
    )
    assert uncited_documents(tmp_path, tmp_path) == ["test_x.py: STYLE.md"]


PRODUCT_FOLDERS = {"vllm_balance": "vllm_balance", "vllm_balance.shim": "shim"}
PRODUCT_FOLDERS["vllm_balance.compat"] = "compat"


def imported_names(path: Path) -> set[tuple[str, str | None]]:
    """``(module, name)`` for every ``from module import name`` anywhere in ``path``'s body
    (function-level too), ``(module, None)`` for ``import module``; but for imports that only
    type checkers see."""
    tree = ast.parse(path.read_text())
    # Annotation-only imports (``if TYPE_CHECKING:``) never run: they make no loop.
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update((node.module, alias.name) for alias in node.names)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the product modules it imports."""
    modules = {}
    for package, folder in PRODUCT_FOLDERS.items():
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root / folder).with_suffix("").parts
            modules[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    graph = {}
    for name, path in modules.items():
        # ``from package import module`` reads the module; ``from module import name`` the module.
        found = {f"{m}.{n}" if f"{m}.{n}" in modules else m for m, n in imported_names(path)}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


# The scripts outside the product import each other by file name (their folder is on sys.path)
# or, for benchmarks, as ``benchmarks.<name>``.
SCRIPT_FOLDERS = ("benchmarks", "tools", "upstream_patch", "upstream_patch/vllm-ascend")


def script_import_graph(root: Path) -> dict[str, set[str]]:
    """Script -> the scripts it imports (its own folder first, as Python finds them)."""
    scripts = [path for folder in SCRIPT_FOLDERS for path in sorted((root / folder).glob("*.py"))]

    def resolve(name: str, importer: Path) -> Path | None:
        folder, _, stem = name.rpartition(".")
        if folder and folder not in SCRIPT_FOLDERS:
            return None
        candidates = [
            p for p in scripts if p.stem == stem and (not folder or p.parent.name == folder)
        ]
        own = [p for p in candidates if p.parent == importer.parent]
        return (own or candidates or [None])[0]

    graph = {}
    for path in scripts:
        imports = imported_names(path)
        names = {m for m, _ in imports} | {f"{m}.{n}" for m, n in imports if n}
        targets = {resolve(name, path) for name in names} - {None, path}
        graph[str(path.relative_to(root))] = {str(t.relative_to(root)) for t in targets if t}
    return graph


def import_cycle(root: Path, graph=import_graph) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph(root)).prepare()
    except graphlib.CycleError as exc:
        return exc.args[1]
    return None


def test_product_has_no_import_cycles():
    """Each product module can be read and changed knowing only what it imports."""
    assert import_cycle(ROOT) is None


def test_import_cycle_check_finds_a_loop(tmp_path):
    """Negative control: activation -> registry -> activation (the loop issue 15 removed)."""
    for folder in PRODUCT_FOLDERS.values():
        (tmp_path / folder).mkdir()
    (tmp_path / "vllm_balance" / "activation.py").write_text("from vllm_balance import registry\n")
    (tmp_path / "vllm_balance" / "registry.py").write_text(
        "def f():\n    from vllm_balance.activation import g\n"
    )
    assert sorted(set(import_cycle(tmp_path))) == [
        "vllm_balance.activation",
        "vllm_balance.registry",
    ]


def test_scripts_have_no_import_cycles():
    """The same for benchmarks/, tools/ and upstream_patch/ (benchmarks' run.py and
    instructions.py imported each other until issue 15)."""
    assert import_cycle(ROOT, script_import_graph) is None
    graph = script_import_graph(ROOT)
    assert "upstream_patch/seam_patch.py" in graph["upstream_patch/vllm-ascend/series.py"]
    assert "benchmarks/steps.py" in graph["benchmarks/serve_report.py"]


def test_script_cycle_check_finds_a_loop(tmp_path):
    """Negative control: run.py -> instructions.py -> run.py, the loop issue 15 removed."""
    for folder in SCRIPT_FOLDERS:
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    (tmp_path / "benchmarks" / "run.py").write_text("import instructions\n")
    (tmp_path / "benchmarks" / "instructions.py").write_text("from benchmarks.run import x\n")
    assert sorted(set(import_cycle(tmp_path, script_import_graph))) == [
        "benchmarks/instructions.py",
        "benchmarks/run.py",
    ]
