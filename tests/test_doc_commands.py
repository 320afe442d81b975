"""Every nox session and every script the docs name exists and starts.

Sessions are checked against nox's own listing (``nox -l --json``), scripts and our modules by
running them with ``--help``: a doc that names a session noxfile.py dropped, or a script that
moved or no longer starts, fails here. What a command then does is checked where it runs (CI or
its nox session), not by parsing the docs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest
from conftest import session_has_seam

# The docs are the same text in every test session: checked once, in ``tests-release`` (the
# release-tag pin without the seam) or outside nox; the other three sessions skip it.
if session_has_seam() or os.environ.get("VLLM_BALANCE_PIN", "release-tag") != "release-tag":
    pytest.skip("doc commands are checked in tests-release only", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("upstream_patch/**/*.md")])
SESSION = re.compile(r"\bnox -s ([a-z0-9][\w-]*)")
SCRIPT = re.compile(r"\bpython3? ([\w./-]+\.py)\b")
# Only our own modules and console scripts: vLLM's and pip's are theirs to keep working.
MODULE = re.compile(r"\bpython3? -m ((?:vllm_balance|tests)(?:\.\w+)+)")
CONSOLE_SCRIPT = re.compile(r"(?<![\w-])(vllm-balance-(?:sim|smoke))\b")


def named(pattern: re.Pattern, texts: list[str]) -> list[str]:
    return sorted({match for text in texts for match in pattern.findall(text)})


def doc_texts() -> list[str]:
    return [doc.read_text(encoding="utf-8") for doc in DOCS]


def nox_listing(*args: str) -> list[str]:
    """The sessions ``nox -l --json ARGS`` selects; nox itself fails on a name it lacks."""
    listing = subprocess.run(
        [sys.executable, "-m", "nox", "-l", "--json", *args],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert listing.returncode == 0, listing.stderr
    return [entry["session"] for entry in json.loads(listing.stdout)]


@cache
def nox_sessions() -> frozenset[str]:
    """Every session noxfile.py defines (the ``-k`` selects all, not only the default set)."""
    return frozenset(nox_listing("-k", "not __no_such_session__"))


def missing_sessions(texts: list[str]) -> list[str]:
    return [name for name in named(SESSION, texts) if name not in nox_sessions()]


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


def failing_commands(texts: list[str]) -> dict[str, str]:
    commands = help_argv(texts)
    with ThreadPoolExecutor(max_workers=2) as pool:  # CI has two cores
        answers = list(pool.map(answer_help, commands))
    return {" ".join(argv[1:] if argv[0] == sys.executable else argv): answer
            for argv, answer in zip(commands, answers) if answer}  # fmt: skip


def test_nox_sessions_named_in_the_docs_exist():
    assert named(SESSION, doc_texts()), "no nox session found in the docs: is SESSION wrong?"
    assert missing_sessions(doc_texts()) == []


def test_default_sessions_exist():
    """``nox`` alone (the README's test command, CI) runs these: nox refuses a missing one."""
    assert "lint" in nox_listing()


def test_scripts_and_modules_named_in_the_docs_answer_help():
    texts = doc_texts()
    assert len(help_argv(texts)) >= 10, "fewer scripts than the docs name: is SCRIPT wrong?"
    assert failing_commands(texts) == {}


@pytest.mark.parametrize(
    "stale, caught",
    [
        ("Run `nox -s tests-nightly`.", "session"),
        ("`python tools/no_such_tool.py --write`", "command"),
        ("`python -m vllm_balance.no_such_module`", "command"),
    ],
    ids=["dropped-session", "moved-script", "missing-module"],
)
def test_a_stale_doc_command_is_caught(stale: str, caught: str):
    """Negative control: the same checks reject a session, script or module that is gone."""
    if caught == "session":
        assert missing_sessions([stale]) == ["tests-nightly"]
    else:
        assert len(failing_commands([stale])) == 1
