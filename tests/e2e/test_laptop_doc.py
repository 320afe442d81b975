"""docs/operations.md "Try it on a laptop" is exactly what the e2e session's shim row runs.

A doc claim is true only if a command exercised it: the documented server command must be the
launcher's own argv for the shim row (same flags, same ``--additional-config``) and its
environment the launcher's values, and the model command must make the model that server loads.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.e2e.runs import BALANCE_ON, MODEL_DTYPE, ROOT
from tests.e2e.server import ServerSpec
from tests.e2e.tiny_moe import build_parser

DOC_PORT = 8000
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def documented(pattern: str) -> str:
    """The one line of a shell block in docs/operations.md that matches ``pattern``."""
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```(?:bash|sh|shell)?\n(.*?)^```", text, re.M | re.S)
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


def test_laptop_server_command_is_the_shim_rows_server():
    env, argv = server_command()
    model = Path(argv[argv.index("--model") + 1])
    spec = ServerSpec(model, dtype=MODEL_DTYPE, additional_config=BALANCE_ON)
    assert argv == spec.argv("python", DOC_PORT)
    launcher_env = spec.environ(Path("stacks"))
    assert env == {name: launcher_env[name] for name in env}
    assert {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"} <= set(env)


def test_laptop_model_command_makes_what_the_server_loads():
    argv = shlex.split(documented(r"-m tests\.e2e\.tiny_moe"))
    args = build_parser().parse_args(argv[argv.index("tests.e2e.tiny_moe") + 1 :])
    _, server_argv = server_command()
    assert str(args.directory) == server_argv[server_argv.index("--model") + 1]
    assert args.dtype == MODEL_DTYPE
