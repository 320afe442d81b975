"""The simulator's command line as users meet it: every option explained once, every bad input
answered with one line and exit status 2 (never a traceback), and the judgement ``advise`` and
the operating envelope share (``balance_sim.compare``).

No test here runs a simulation: bad inputs are rejected before any scheduler is built.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from balance_sim.__main__ import build_parser, main
from balance_sim.compare import HELPS, HURTS, MIXED, NEUTRAL, UNCLEAR, changes, verdict
from balance_sim.metrics import Summary

pytestmark = pytest.mark.path_independent

ROOT = Path(__file__).resolve().parent.parent


def all_parsers() -> list[argparse.ArgumentParser]:
    parser = build_parser()
    return [parser, *parser.commands.values()]


@pytest.mark.parametrize("parser", all_parsers(), ids=lambda p: p.prog)
def test_every_option_has_help_and_states_its_default_at_most_once(parser):
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{parser.prog} {action.option_strings}: no help text"
        rendered = action.help % {"default": action.default} if "%(" in action.help else action.help
        assert rendered.count("default") <= 1, f"{action.option_strings}: {rendered}"
    text = parser.format_help()
    assert "(default: None)" not in text and "%(default)" not in text


def _error_of(argv: list[str], capsys) -> str:
    """Run the CLI; it must stop with status 2 and exactly one line on stderr."""
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    assert status == 2, (status, captured.err)
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    # One prefix for every command's errors, the program's name.
    assert lines[0].startswith("vllm-balance-sim: error: "), lines[0]
    return lines[0]


def _step_model(tmp_path, content: dict) -> str:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(content))
    return str(path)


def _sim_without_site_packages(*args: str) -> subprocess.CompletedProcess:
    """``python -S -m balance_sim ARGS`` from the checkout: this venv's interpreter without its
    site-packages, a real Python that has the standard library and the checkout, no torch and
    no vLLM (a user's system python3 as the simulator meets it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    command = [sys.executable, "-S", "-m", "balance_sim", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_without_torch_a_run_is_one_line_naming_the_nox_session_and_exit_2():
    lacking = subprocess.run([sys.executable, "-S", "-c", "import torch"], capture_output=True)
    assert lacking.returncode != 0, "python -S imports torch here: the test would prove nothing"

    done = _sim_without_site_packages("--dp", "4")

    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    line = done.stderr.strip()
    assert line.startswith("vllm-balance-sim: error: no numpy, torch or vLLM in this Python"), line
    assert "`python3 -m nox -s sim -- --dp 4`" in line, line


def test_without_torch_help_and_a_bad_option_still_answer():
    assert "usage: vllm-balance-sim" in _sim_without_site_packages("--help").stdout
    done = _sim_without_site_packages("--dps", "4")
    assert done.returncode == 2 and "unrecognized arguments: --dps" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--dp", "0"], "argument --dp: expected an integer >= 1, got '0'"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: expected an integer >= 1"),
        (["--num-requests", "0"], "argument --num-requests: expected an integer >= 1"),
        (["--rate", "-1"], "argument --rate: expected a number > 0, got '-1'"),
        (["--concurrency", "-5"], "argument --concurrency: expected an integer >= 1"),
        (
            ["--snapshot-interval-ms", "-1"],
            "argument --snapshot-interval-ms: expected a number >= 0",
        ),
        (["--seed", "-1"], "argument --seed: expected an integer >= 0"),
        (["--dp", "eight"], "argument --dp: expected an integer >= 1, got 'eight'"),
        (["--burstiness", "nan"], "argument --burstiness: expected a number > 0"),
        (["--prompt-len", "uniform:900:100"], "LO must be <= HI"),
        (["--policies", "on,sometimes"], "policy 'sometimes'"),
        (
            ["--trace", "no/such/trace.jsonl"],
            "argument --trace: no such file: 'no/such/trace.jsonl'",
        ),
        (["--step-model", "no/such/model.json"], "cannot read the step-model file"),
        (["advise", "--dp", "0"], "argument --dp: expected an integer >= 1"),
        (["advise", "--seeds", "3"], "at least 2 seeds"),
        (["envelope", "--rate", "5"], "envelope sets the load itself"),
        (["envelope", "--shared-fractions", "0,1.5"], "expected a number between 0 and 1"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_a_bad_input_is_one_line_and_exit_2(argv, expected, capsys):
    assert expected in _error_of(argv, capsys)


@pytest.mark.parametrize(
    "content, expected",
    [
        ({"fixed_ms": 20, "per_token_ms": 1}, "unknown key 'per_token_ms'"),
        ({"fixed_ms": -1}, "key 'fixed_ms' must be a number >= 0, got -1"),
        ({"shared_fraction": 1.5}, "key 'shared_fraction' must be between 0 and 1"),
        ({"gather_ms": "fast"}, "key 'gather_ms' must be a number >= 0"),
    ],
)
def test_a_bad_step_model_file_is_one_line_and_exit_2(tmp_path, content, expected, capsys):
    line = _error_of(["--step-model", _step_model(tmp_path, content)], capsys)
    assert "argument --step-model:" in line and expected in line


# --- compare: the judgement advise and the envelope share ------------------------------------


def _summary(ttft_p99=1000.0, ttft_p50=200.0, tok=2000.0, tpot=90.0, policy="p") -> Summary:
    return Summary(policy, tok, ttft_p50, ttft_p99, tpot, tpot * 1.2, 0.8, 0.0, 100, 100, 10, 1.0)


@pytest.mark.parametrize(
    "variant, expected",
    [
        ([_summary(ttft_p99=300), _summary(ttft_p99=400)], HELPS),
        ([_summary(ttft_p50=600), _summary(ttft_p50=500)], HURTS),
        ([_summary(ttft_p99=300, tok=1500), _summary(ttft_p99=350, tok=1600)], MIXED),
        ([_summary(tpot=92), _summary(tpot=88)], NEUTRAL),
        # TPOT is shown, not judged: a hold shortens batches whatever it costs elsewhere.
        ([_summary(tpot=50), _summary(tpot=55)], NEUTRAL),
        ([_summary(ttft_p99=300), _summary(ttft_p99=1900)], UNCLEAR),
    ],
)
def test_verdict_needs_a_change_beyond_5_percent_on_every_seed(variant, expected):
    assert verdict(changes([_summary(), _summary()], variant)) == expected


def test_seeds_beyond_5_percent_on_both_sides_are_unclear_for_advise_only():
    """A small mean over seeds that straddle zero is no evidence of "no difference" (advise);
    the envelope keeps the mean-only rule its published tables were labelled with."""
    straddling = [_summary(ttft_p50=170), _summary(ttft_p50=240)]  # -15% and +20%: mean +2.5%
    metric_changes = changes([_summary(), _summary()], straddling)
    assert verdict(metric_changes) == NEUTRAL
    assert verdict(metric_changes, straddle_is_unclear=True) == UNCLEAR


def test_a_rate_maps_back_to_the_concurrency_it_was_made_from():
    from balance_sim.runner import SimOptions, build_workload, concurrency_for_rate

    for concurrency in (100, 256, 400):
        options = SimOptions(concurrency=concurrency)
        rate = build_workload(options).rate_per_s
        # The estimate truncates token counts to integers: the inverse is good to ~1%.
        assert concurrency_for_rate(options, rate, 576, 128) == pytest.approx(concurrency, rel=0.01)
