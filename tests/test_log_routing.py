"""Balance's log lines go through whatever logging vLLM configures, whenever it configures it.

Each case is a fresh interpreter that imports the package logger first and then configures
logging as a vLLM process does: since 0.31 ``configure_logging()`` runs late (from the CLI's
arguments, at the start of each engine process), on 0.30 at ``import vllm``. The negative control
is the old ``log.py``, which copied the ``vllm`` logger's handlers once at import: on 0.31+ it
printed nothing at INFO, the lost activation and stats lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_balance.log import LOGGER_NAME

pytestmark = pytest.mark.path_independent

CHILD = textwrap.dedent(
    """
    import json, logging, sys
    {logger}
    import vllm.logger as vllm_logger
    settings = json.loads(sys.argv[1])
    # The activation's lines: emitted in balance's run_engine_core wrapper, before vLLM configures.
    logger.info("balance-probe early")
    if hasattr(vllm_logger, "configure_logging"):  # 0.31+: configured late, as an engine process
        from vllm.config.logging import LoggingConfig
        vllm_logger.configure_logging(LoggingConfig(**settings))
    if {root!r}:
        logging.basicConfig(level=logging.INFO, format="ROOT %(message)s", stream=sys.stdout)
    if "vllm_balance.log" in sys.modules:  # what the engine core's __init__ does
        sys.modules["vllm_balance.log"].release_held_records()
    logger.info("balance-probe info")
    logger.warning("balance-probe warning")
    """
)
OURS = "from vllm_balance.log import logger"
# The log.py before the fix: the vllm logger's handlers, copied once at import.
COPIED_AT_IMPORT = textwrap.dedent(
    """
    from vllm.logger import init_logger
    logger = init_logger("vllm_balance")
    for handler in logging.getLogger("vllm").handlers:
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.getLogger("vllm").level)
    """
)


def vllm_logging_unset() -> dict[str, str]:
    """This environment without vLLM's logging settings (the simulator sets some in-process)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}


def configures_late() -> bool:
    import vllm.logger

    return hasattr(vllm.logger, "configure_logging")


def run(settings: dict | None = None, env: dict | None = None, logger: str = OURS, root=False):
    """The child's stdout and stderr together (vLLM's handler writes to stdout by default)."""
    script = CHILD.format(logger=textwrap.indent(logger, ""), root=root)
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(settings or {})],
        capture_output=True,
        text=True,
        timeout=300,
        env={**vllm_logging_unset(), **(env or {})},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def late_only(settings: dict) -> dict:
    if settings and not configures_late():
        pytest.skip("this vLLM configures its logging at import, from the environment only")
    return settings


def test_info_lines_print_through_vllms_handler():
    output = run()
    assert "balance-probe info" in output and "balance-probe warning" in output
    for probe in ("balance-probe early", "balance-probe info"):
        line = next(ln for ln in output.splitlines() if probe in ln)
        assert "INFO" in line.split("balance-probe")[0], line  # vLLM's format, not a bare message
    assert output.index("balance-probe early") < output.index("balance-probe info")


def test_vllms_log_level_applies():
    settings = late_only({"log_level": "WARNING"})
    output = run(settings, env={"VLLM_LOGGING_LEVEL": "WARNING"})
    assert "balance-probe info" not in output and "balance-probe warning" in output
    assert "balance-probe early" not in output  # held, then dropped at vLLM's level


def test_json_format_applies():
    settings = late_only({"formatter": "json"})
    import vllm.config.logging as logging_config

    if "formatter" not in getattr(logging_config.LoggingConfig, "__dataclass_fields__", {}):
        pytest.skip("this vLLM has no JSON log format")
    output = run(settings)
    records = [json.loads(ln) for ln in output.splitlines() if ln.startswith("{")]
    assert any("balance-probe info" in json.dumps(r) for r in records), output[-2000:]


def test_with_vllm_logging_off_lines_reach_the_root_logger():
    output = run(
        late_only({"configure_logging": False}), {"VLLM_CONFIGURE_LOGGING": "0"}, root=True
    )
    assert "ROOT balance-probe info" in output and "ROOT balance-probe early" in output


def test_a_users_logging_config_file_is_respected(tmp_path):
    config = {
        "version": 1,
        "disable_existing_loggers": True,
        "formatters": {"mine": {"format": "MINE %(name)s %(message)s"}},
        "handlers": {
            "out": {
                "class": "logging.StreamHandler",
                "formatter": "mine",
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False}},
    }
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    output = run(env={"VLLM_LOGGING_CONFIG_PATH": str(path)})
    assert "MINE vllm.vllm_balance balance-probe info" in output, output[-2000:]
    assert "MINE vllm.vllm_balance balance-probe early" in output, output[-2000:]


def test_negative_control_handlers_copied_at_import_lose_the_info_line():
    if not configures_late():
        pytest.skip("vLLM configures at import here: the copy finds the handler")
    output = run(logger=COPIED_AT_IMPORT)
    assert "balance-probe info" not in output


def test_negative_control_a_child_of_vllm_without_the_hold_loses_the_early_line():
    """The logger without ``_HeldUntilVllmConfigures``: the activation's line, emitted before
    vLLM configured the engine process, met the root's WARNING level and was never made."""
    if not configures_late():
        pytest.skip("vLLM configures at import here: nothing is emitted before it")
    without_hold = f"from vllm.logger import init_logger\nlogger = init_logger({LOGGER_NAME!r})"
    output = run(logger=without_hold)
    assert "balance-probe info" in output and "balance-probe early" not in output
