#!/usr/bin/env python3
"""Check that every nox session and every script the docs name exists and starts, and that CI
runs the README's test command verbatim.

    python tools/check_doc_commands.py [--nox PYTHON]

Run by the lint session (the docs are the same text in every test session, so once per CI run).
Sessions are checked against nox's own listing (``PYTHON -m nox -l --json``; PYTHON: the
interpreter that has nox, this one by default), scripts and our modules by running them with
``--help`` from the repository root: a doc that names a session noxfile.py dropped, or a script
that moved or no longer starts, fails here. What a command then does is checked where it runs
(CI or its nox session), not by parsing the docs. Exit 1 with one line per problem.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("upstream_patch/**/*.md")])
SESSION = re.compile(r"\bnox -s ([a-z0-9][\w-]*)")
SCRIPT = re.compile(r"\bpython3? ([\w./-]+\.py)\b")
# Only our own modules and console scripts: vLLM's and pip's are theirs to keep working.
MODULE = re.compile(
    r"\bpython3? -m (balance_sim(?:\.\w+)*|(?:vllm_balance|balance_testbed|tests)(?:\.\w+)+)"
)
CONSOLE_SCRIPT = re.compile(r"(?<![\w-])(vllm-balance-(?:sim|smoke))\b")
# Fewer than this many scripts found means a pattern above broke, not that the docs changed.
MIN_COMMANDS = 10


def named(pattern: re.Pattern, texts: list[str]) -> list[str]:
    return sorted({match for text in texts for match in pattern.findall(text)})


def nox_sessions(nox_python: str) -> set[str]:
    """Every session noxfile.py defines (the ``-k`` selects all, not only the default set)."""
    listing = subprocess.run(
        [nox_python, "-m", "nox", "-l", "--json", "-k", "not __no_such_session__"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if listing.returncode != 0:
        raise SystemExit(f"nox -l failed: {listing.stderr.strip()}")
    return {entry["session"] for entry in json.loads(listing.stdout)}


def help_argv(texts: list[str]) -> list[list[str]]:
    """The ``--help`` command line of each script, module and console script named."""
    bin_dir = Path(sys.executable).parent
    return (
        [[sys.executable, script, "--help"] for script in named(SCRIPT, texts)]
        + [[sys.executable, "-m", module, "--help"] for module in named(MODULE, texts)]
        + [[str(bin_dir / name), "--help"] for name in named(CONSOLE_SCRIPT, texts)]
    )


def answer_help(argv: list[str]) -> str | None:
    """None when the command prints its usage and exits 0; else its last error line."""
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    except OSError as exc:
        return f"{argv[0]}: {exc.strerror}"
    if done.returncode == 0 and "usage:" in done.stdout.lower():
        return None
    tail = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
    return f"exit {done.returncode}: {tail[-1]}"


def ci_command_problem() -> str | None:
    """.ci/run's last command must be the README's test command (a ```bash block of its own)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci_lines = [ln for ln in (ROOT / ".ci/run").read_text().splitlines() if ln and ln[0] != "#"]
    if f"```bash\n{ci_lines[-1]}\n```" not in readme:
        return f".ci/run runs {ci_lines[-1]!r}, not the README's test command"
    return None


def problems(nox_python: str) -> list[str]:
    texts = [doc.read_text(encoding="utf-8") for doc in DOCS]
    found = []
    sessions = named(SESSION, texts)
    if not sessions:
        found.append("no `nox -s` session found in the docs: is SESSION wrong?")
    defined = nox_sessions(nox_python)
    found += [f"the docs name `nox -s {name}`; noxfile.py has no such session"
              for name in sessions if name not in defined]  # fmt: skip
    commands = help_argv(texts)
    if len(commands) < MIN_COMMANDS:
        found.append(f"only {len(commands)} scripts found in the docs: is SCRIPT wrong?")
    with ThreadPoolExecutor(max_workers=2) as pool:  # CI has two cores
        answers = pool.map(answer_help, commands)
    for argv, answer in zip(commands, answers):
        if answer:
            shown = ["python", *argv[1:]] if argv[0] == sys.executable else argv
            found.append(f"`{' '.join(shown)}` does not start: {answer}")
    return found + [p for p in [ci_command_problem()] if p]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nox", default=sys.executable, help="an interpreter that has nox")
    found = problems(parser.parse_args().nox)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
