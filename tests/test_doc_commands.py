"""Every command in the docs runs somewhere and still parses (issue 7; docs/commands.md).

tools/doc_commands.py finds the commands and records where each runs. These tests check the
commands themselves without running them: nox session names against noxfile.py, each script's
arguments against that script's own argparse (imported, never run), pytest paths and markers,
and the ``vllm serve`` example against vLLM's own CLI parser. A doc that keeps a flag after the
code dropped it fails here; each checker has a negative control that shows it can fail.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib.metadata
import importlib.util
import io
import json
import re
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import doc_commands  # noqa: E402
from doc_commands import DocCommand, command_parts, nox_sessions  # noqa: E402

COMMANDS = doc_commands.all_commands()
SIM_MODULE = "vllm_balance.sim"


def split_program(argv: list[str]) -> tuple[str, list[str]]:
    """('nox', args), ('vllm_balance.sim', args), ('upstream_patch/apply.py', args), ..."""
    if argv[0] in ("python", "python3"):
        return (argv[2], argv[3:]) if argv[1] == "-m" else (argv[1], argv[2:])
    if argv[:2] == ["vllm", "serve"]:
        return "vllm serve", argv[2:]
    return argv[0], argv[1:]


def doc_parts(wanted) -> list:
    """pytest params (command, program, args) for every ``&&`` part whose program is wanted."""
    return [
        pytest.param(command, program, args, id=f"{command.doc}:{command.line}")
        for command in COMMANDS
        for program, args in map(split_program, command_parts(command.text))
        if wanted(program)
    ]


def parse_quietly(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """None when ``args`` parse, else argparse's error message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(args)
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    return None


# --- nox ------------------------------------------------------------------------------------


def nox_problems(args: list[str]) -> list[str]:
    """Unknown session names; a ``-k WORD`` (pytest posarg) that no test name contains."""
    named, taking = [], False
    options, _, posargs = " ".join(args).partition(" -- ")
    for word in options.split():
        if word in ("-s", "--session", "--sessions"):
            taking = True
        elif word.startswith("-"):
            taking = False
        elif taking:
            named.append(word)
    problems = [f"no nox session {name!r}" for name in named if name not in nox_sessions()]
    words = posargs.split()
    if "-k" in words:
        keyword = words[words.index("-k") + 1]
        tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
        if not re.search(rf"def test_\w*{re.escape(keyword)}", tests):
            problems.append(f"-k {keyword!r} selects no test")
    return problems


@pytest.mark.parametrize(("command", "program", "args"), doc_parts(lambda p: p == "nox"))
def test_nox_sessions_named_in_the_docs_exist(command: DocCommand, program: str, args: list[str]):
    assert nox_problems(args) == [], command.text


def test_nox_default_sessions_exist():
    """``nox`` alone (README, .ci/run) runs ``nox.options.sessions``."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    (defaults,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions"
    ]
    assert set(defaults) <= nox_sessions()


# --- scripts: their own argparse -----------------------------------------------------------


@functools.cache
def script_module(program: str):
    """Import a script by path under a private name; its ``if __name__`` block does not run."""
    name = "doc_commands_script_" + re.sub(r"\W", "_", program)
    spec = importlib.util.spec_from_file_location(name, ROOT / program)
    assert spec and spec.loader, f"{program}: not a Python file"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def script_parser(program: str) -> argparse.ArgumentParser | None:
    """The script's ``build_parser()``; None if it has none."""
    if program == SIM_MODULE:
        from vllm_balance.sim.__main__ import build_parser

        return build_parser()
    build_parser = getattr(script_module(program), "build_parser", None)
    return build_parser() if build_parser else None


def script_problems(program: str, args: list[str]) -> list[str]:
    if program != SIM_MODULE and not (ROOT / program).is_file():
        return [f"{program}: no such script"]
    parser = script_parser(program)
    if parser is None:  # e.g. tools/support_matrix.py: reads only sys.argv's --check
        return [f"{program} takes no documented arguments: {args}"] if args else []
    # The simulator's argparse checks each --policies entry with make_policy() itself.
    error = parse_quietly(parser, args)
    return [f"{program}: {error}"] if error else []


@pytest.mark.parametrize(
    ("command", "program", "args"),
    doc_parts(lambda p: p == SIM_MODULE or p.endswith(".py")),
)
def test_script_arguments_in_the_docs_parse_with_the_scripts_own_argparse(
    command: DocCommand, program: str, args: list[str]
):
    assert script_problems(program, args) == [], command.text


def test_apply_git_synopsis_parses_as_apply_arguments():
    """upstream_patch/README.md writes ``git <checkout> [--ref REF]`` for ``apply.py git ...``."""
    synopses = [c for c in COMMANDS if re.match(r"git <", c.text)]
    assert synopses
    for command in synopses:
        (argv,) = command_parts(re.sub(r"[\[\]]", "", command.text))
        assert script_problems("upstream_patch/apply.py", argv) == [], command.text


# --- pytest, pip, the console script, the rest ---------------------------------------------


def pytest_problems(args: list[str], registered: list[str]) -> list[str]:
    """Paths exist here (or are the vLLM-tree files run_vllm_tests.py runs); markers exist.

    ``registered``: pytest's own ``markers`` ini lines (``name: help``).
    """
    own_tests = script_module("upstream_patch/run_vllm_tests.py")
    vllm_tree = {own_tests.ENTRY_TEST, own_tests.ASYNC_TEST, own_tests.SEAM_TEST}
    markers = {line.split(":")[0].strip() for line in registered}
    problems, words = [], iter(args)
    for word in words:
        if word == "-m":
            names = set(re.findall(r"\w+", next(words))) - {"and", "or", "not"}
            problems += [f"unregistered marker {name!r}" for name in sorted(names - markers)]
        elif not word.startswith("-") and not (ROOT / word).exists() and word not in vllm_tree:
            problems.append(f"no such test path {word}")
    return problems


@pytest.mark.parametrize(("command", "program", "args"), doc_parts(lambda p: p == "pytest"))
def test_pytest_commands_name_existing_paths_and_registered_markers(
    command: DocCommand, program: str, args: list[str], pytestconfig: pytest.Config
):
    assert pytest_problems(args, pytestconfig.getini("markers")) == [], command.text


def pip_problems(args: list[str]) -> list[str]:
    """Operands that are neither this distribution nor a file or a project folder here."""
    (name,) = re.findall(r'^name = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    operands = [w for w in args[1:] if not w.startswith("-")]
    return [
        f"{w}: not {name}, a file or a project folder here"
        for w in operands
        if not (w == name or (ROOT / w).is_file() or (ROOT / w / "pyproject.toml").is_file())
    ]


@pytest.mark.parametrize(("command", "program", "args"), doc_parts(lambda p: p == "pip"))
def test_pip_commands_name_this_distribution_a_file_or_a_project_folder(
    command: DocCommand, program: str, args: list[str]
):
    assert pip_problems(args) == [], command.text


def test_console_script_runs_the_simulators_main():
    """``vllm-balance-sim`` as installed (the nox sessions install this checkout)."""
    named = {c.text.split()[0] for c in COMMANDS if c.text.startswith("vllm-balance-")}
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert named and all(scripts[name].value == "vllm_balance.sim.__main__:main" for name in named)


def test_step_model_json_written_by_echo_loads(tmp_path: Path):
    from vllm_balance.sim.stepmodel import load_step_model

    echoes = [c for c in COMMANDS if c.text.startswith("echo ")]
    assert echoes
    for command in echoes:
        (argv,) = command_parts(command.text)
        (target,) = [argv[i + 1] for i, word in enumerate(argv) if word == ">"]
        path = tmp_path / target
        path.write_text(argv[1])
        assert json.loads(argv[1]) and load_step_model(path), command.text


def test_env_variables_in_the_docs_are_read_by_the_code():
    variables = {
        word.split("=")[0]
        for command in COMMANDS
        for word in shlex.split(command.text)
        if doc_commands.ENV_ASSIGNMENT.match(word)
    }
    sources = [ROOT / "noxfile.py"]
    for folder in ("vllm_balance", "shim", "compat", "tests", "tools", "benchmarks"):
        sources += (ROOT / folder).rglob("*.py")
    code = "\n".join(p.read_text() for p in sources if p != Path(__file__))
    assert variables and all(name in code for name in variables)


# --- vllm serve: vLLM's own CLI parser -----------------------------------------------------


def vllm_serve_problems(args: list[str]) -> list[str]:
    """Parse with vLLM's EngineArgs CLI; the additional_config must turn balance on.

    The full ``vllm serve`` parser lives in vllm.entrypoints.cli.serve, whose import needs the
    OpenAI front end (fastapi), which the CPU test venv does not install; the engine arguments,
    which are all this example passes, are EngineArgs' own. Its defaults need a device type, and
    a vLLM that is not a CPU build reports none here, so "cpu" stands in while the parser is built.
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from vllm_balance.config import balance_enabled

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before the argparse_utils split
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]

    model, *options = args  # `vllm serve MODEL`: the positional is EngineArgs' --model
    with mock.patch.object(current_platform, "device_type", current_platform.device_type or "cpu"):
        parser = FlexibleArgumentParser()
        parser = EngineArgs.add_cli_args(parser) or parser
        error = parse_quietly(parser, ["--model", model, *options])
        if error:
            return [f"vllm serve: {error}"]
        engine_args = EngineArgs.from_cli_args(parser.parse_args(["--model", model, *options]))
    try:
        enabled = balance_enabled(engine_args)  # reads .additional_config, as from a VllmConfig
    except ValueError as exc:
        return [str(exc)]
    return [] if enabled else ["--additional-config does not enable balance scheduling"]


@pytest.mark.parametrize(
    ("command", "program", "args"),
    [p for p in doc_parts(lambda p: p == "vllm serve") if p.values[2]],  # not bare mentions
)
def test_vllm_serve_example_parses_with_vllms_cli_and_enables_balance(
    command: DocCommand, program: str, args: list[str]
):
    assert vllm_serve_problems(args) == [], command.text


# --- the checkers can fail: stale commands ----------------------------------------------------


@pytest.mark.parametrize(
    ("stale", "why"),
    [
        ("nox -s tests-nightly", "no nox session 'tests-nightly'"),
        ("python3 -m nox -s tests-release -- -k no_test_has_this", "selects no test"),
        ("python upstream_patch/apply.py installed --dry-run", "unrecognized arguments: --dry-run"),
        ("python upstream_patch/apply.py git", "required: checkout"),
        ("python tests/mutation/run.py --mutant not_a_mutant", "invalid choice: 'not_a_mutant'"),
        ("python -m vllm_balance.sim --dps 8", "unrecognized arguments: --dps 8"),
        ("python -m vllm_balance.sim --policies on,cap-2", "policy 'cap-2'"),
        ("python tools/support_matrix.py --write", "takes no documented arguments"),
        ("python tools/no_such_script.py", "no such script"),
        ("python benchmarks/run.py --parts sim --repetitions 3", "unrecognized arguments"),
        ("python benchmarks/run.py --parts schedul", "unknown part(s) ['schedul']"),
        ('python -m pytest tests/multiproc -m "not sluggish"', "unregistered marker 'sluggish'"),
        ("python -m pytest tests/no_such_dir", "no such test path"),
        ("vllm serve m --data-parallel-sizes 8", "unrecognized arguments: --data-parallel-sizes"),
        ("pip install --no-deps -e tests/e2e", "not vllm-balance-scheduling, a file or a project"),
        ("""vllm serve m --additional-config '{"enable_balance_scheduling": "yes"}'""", "boolean"),
        ("""vllm serve m --additional-config '{"balance": true}'""", "does not enable balance"),
    ],
)
def test_a_stale_command_is_rejected_by_the_same_checker(
    stale: str, why: str, pytestconfig: pytest.Config
):
    (argv,) = command_parts(stale)
    program, args = split_program(argv)
    if program == "nox":
        problems = nox_problems(args)
    elif program == "pytest":
        problems = pytest_problems(args, pytestconfig.getini("markers"))
    elif program == "vllm serve":
        problems = vllm_serve_problems(args)
    elif program == "pip":
        problems = pip_problems(args)
    else:
        problems = script_problems(program, args)
    assert why in " ".join(problems), problems


# --- the registry and the table ---------------------------------------------------------------


def test_every_doc_command_is_registered_and_docs_commands_md_is_current():
    assert doc_commands.problems() == []


def test_check_reports_an_unregistered_command_and_a_dead_entry_one_line_each(monkeypatch):
    dead = doc_commands.Route(r"nox -s tests-nightly", doc_commands.CI, "-", "-")
    monkeypatch.setattr(doc_commands, "REGISTRY", (*doc_commands.REGISTRY[1:], dead))
    problems = doc_commands.problems()
    assert any("no registry entry for command: python3 -m pip" in line for line in problems)
    assert any("'nox -s tests-nightly' matches no command" in line for line in problems)
    assert all("\n" not in line for line in problems)
