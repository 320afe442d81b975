"""Reading the enable key: one place, AscendConfig first, nested wins, booleans only, env var
deprecated. Every config here is a real ``VllmConfig`` (``balance_testbed/factories.py``)."""

from __future__ import annotations

import functools
import json
import logging
import sys
import types

import pytest

from balance_testbed import factories
from vllm_balance.config import DEPRECATED_ENV_VAR, balance_enabled
from vllm_balance.log import LOGGER_NAME


@functools.cache
def _vllm_config(additional_config_json: str):
    # One real VllmConfig per distinct additional_config (construction is the slow part).
    return factories.make_vllm_config(additional_config=json.loads(additional_config_json))


def enabled_with(additional_config: dict) -> bool:
    return balance_enabled(_vllm_config(json.dumps(additional_config, sort_keys=True)))


@pytest.mark.parametrize(
    "additional_config, expected",
    [
        ({}, False),
        ({"enable_balance_scheduling": True}, True),
        ({"enable_balance_scheduling": False}, False),
        ({"scheduler_config": {"enable_balance_scheduling": True}}, True),
        # Nested (newer vllm-ascend) wins over the top-level key.
        (
            {
                "enable_balance_scheduling": True,
                "scheduler_config": {"enable_balance_scheduling": False},
            },
            False,
        ),
        (
            {
                "enable_balance_scheduling": False,
                "scheduler_config": {"enable_balance_scheduling": True},
            },
            True,
        ),
        ({"scheduler_config": {"other": 1}, "enable_balance_scheduling": True}, True),
    ],
)
def test_enable_key_sources(additional_config, expected):
    assert enabled_with(additional_config) is expected


@pytest.mark.parametrize("value", ["yes", "true", 1, 1.5, ["true"], None])
def test_non_boolean_value_is_a_clear_error_naming_key_and_value(value):
    from vllm_balance.config import BalanceConfigError

    with pytest.raises(BalanceConfigError) as excinfo:
        enabled_with({"enable_balance_scheduling": value})
    assert str(excinfo.value) == (
        f"additional_config.enable_balance_scheduling must be a boolean (JSON true or false), "
        f"got {value!r} of type {type(value).__name__}; "
        'see docs/operations.md, "Configuration keys"'
    )


def test_non_boolean_nested_value_names_the_nested_key():
    nested = {"scheduler_config": {"enable_balance_scheduling": "on"}}
    with pytest.raises(ValueError, match=r"additional_config\.scheduler_config\.enable_balance"):
        enabled_with(nested)


def test_deprecated_env_var_enables_with_a_warning(monkeypatch, caplog, fresh_once_logs):
    monkeypatch.setenv(DEPRECATED_ENV_VAR, "1")
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert enabled_with({}) is True
    assert f"{DEPRECATED_ENV_VAR} is deprecated" in caplog.text


def test_additional_config_wins_over_deprecated_env_var(monkeypatch, caplog, fresh_once_logs):
    monkeypatch.setenv(DEPRECATED_ENV_VAR, "1")
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert enabled_with({"enable_balance_scheduling": False}) is False
    assert "deprecated" not in caplog.text  # never parsed when the key is set


def test_bad_deprecated_env_var_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(DEPRECATED_ENV_VAR, "maybe")
    with pytest.raises(
        ValueError, match=f"{DEPRECATED_ENV_VAR} must be 0/1/true/false, got 'maybe'"
    ):
        enabled_with({})


def test_env_var_is_read_only_in_the_config_module():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readers = [
        str(p.relative_to(root))
        for folder in ("vllm_balance", "shim", "compat")
        for p in (root / folder).rglob("*.py")
        if DEPRECATED_ENV_VAR in p.read_text() or "DEPRECATED_ENV_VAR" in p.read_text()
    ]
    assert readers == ["vllm_balance/config.py"]


# Source 1: vllm-ascend's AscendConfig. vllm-ascend cannot be imported without an NPU, so the
# tests install a stand-in ``vllm_ascend.ascend_config`` with the two attribute shapes the real
# AscendConfig has had; the parsing rules behind them are vllm-ascend's, not under test here.


class AscendConfigUpTo024:
    """vllm-ascend v0.23.0 .. v0.24.0rc1: the key is an attribute of ``AscendConfig`` itself."""

    def __init__(self, enabled) -> None:
        self.enable_balance_scheduling = enabled


class AscendSchedulerConfig:
    """``AscendConfig.scheduler_config`` from vllm-ascend v0.25.1rc1 (#12177, "Nest scheduler
    configuration"): the parsed ``additional_config.scheduler_config``, with other keys beside."""

    def __init__(self, enabled) -> None:
        self.enable_balance_scheduling = enabled
        self.recompute_scheduler_enable = False


class AscendConfigFrom025:
    """vllm-ascend v0.25.1rc1 and later: no top-level attribute, only the nested one."""

    def __init__(self, enabled) -> None:
        self.scheduler_config = AscendSchedulerConfig(enabled)


ASCEND_SHAPES = {"v0.24": AscendConfigUpTo024, "v0.25+": AscendConfigFrom025}


@pytest.fixture
def ascend_config(monkeypatch):
    """Install the stand-in module; returns a setter for the process's AscendConfig.

    Like the real ``get_ascend_config()``, the stand-in raises until an AscendConfig exists in
    the process (vllm-ascend initialises it from the VllmConfig during platform setup).
    """
    current: list = []

    def get_ascend_config():
        if not current:
            raise RuntimeError("stand-in: AscendConfig not initialised in this process")
        return current[0]

    package = types.ModuleType("vllm_ascend")
    package.__path__ = []  # a package, so the submodule import resolves from sys.modules
    module = types.ModuleType("vllm_ascend.ascend_config")
    module.get_ascend_config = get_ascend_config  # type: ignore[attr-defined]
    package.ascend_config = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm_ascend", package)
    monkeypatch.setitem(sys.modules, "vllm_ascend.ascend_config", module)
    return current.append


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("shape", ASCEND_SHAPES)
def test_ascend_config_is_the_primary_source(ascend_config, shape, enabled):
    ascend_config(ASCEND_SHAPES[shape](enabled))
    # additional_config says the opposite, in either form: AscendConfig wins.
    opposite = {"enable_balance_scheduling": not enabled}
    assert enabled_with(opposite) is enabled
    assert enabled_with({"scheduler_config": opposite}) is enabled


def test_uninitialised_ascend_config_falls_back_to_additional_config(ascend_config):
    assert enabled_with({"enable_balance_scheduling": True}) is True
    assert enabled_with({}) is False


@pytest.mark.parametrize("shape", ASCEND_SHAPES)
def test_non_boolean_ascend_config_value_is_a_clear_error(ascend_config, shape):
    # vllm-ascend passes additional_config values through unchecked: a JSON "true" arrives as str.
    ascend_config(ASCEND_SHAPES[shape]("true"))
    with pytest.raises(ValueError, match=r"^enable_balance_scheduling must be a boolean .*'true'"):
        enabled_with({"enable_balance_scheduling": True})


def test_balance_keys_is_every_key_the_options_read():
    """The list a host config accepts on the package's behalf (vllm-ascend's carve-out) is the
    package's key set: every ``balance_*`` key constant, each filling one ``BalanceOptions``
    field, every field filled by one key."""
    import dataclasses

    from vllm_balance import config

    keys = {k: v for k, v in vars(config).items() if k.endswith("_KEY") and isinstance(v, str)}
    ours = {key for key in keys.values() if key.startswith("balance_")}
    assert set(config.BALANCE_KEYS) == ours
    fields = [field.name for field in dataclasses.fields(config.BalanceOptions)]
    assert sorted(key.field for key in config.TUNING_KEYS) == sorted(fields)


def documented_keys() -> list[tuple[str, str, str]]:
    """(key, type, default) of each row of docs/operations.md's "Configuration keys" table."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    section = text.split("## Configuration keys", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    cells = [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]
    return [(key.strip("`"), type_cell, default) for key, type_cell, default, *_ in cells]


def test_the_docs_key_table_is_the_model():
    """The operations guide's key table lists the model's keys in its order, each with the
    type and default the model parses (one place decides; the table cannot drift from it)."""
    from vllm_balance import config

    expected = [(config.ENABLE_KEY, "bool", "`false`")]
    expected += [(k.name, k.type_cell, k.default_cell) for k in config.TUNING_KEYS]
    assert documented_keys() == expected


def test_the_model_defaults_are_the_documented_ones():
    """What an unset key gives is what its Default cell says (unset: None)."""
    from vllm_balance import config

    defaults = config.BalanceOptions()
    for key in config.TUNING_KEYS:
        cell = key.default_cell.strip("`")
        documented = None if cell == "unset" else key.parse(json.loads(cell))
        assert getattr(defaults, key.field) == documented, key.name


def _read(additional_config: dict):
    from vllm_balance.config import read_options

    return read_options(_vllm_config(json.dumps(additional_config, sort_keys=True)))


@pytest.mark.parametrize(
    "additional_config, where, closest",
    [
        (
            {"enable_balance_scheduling": True, "balance_max_frozen_step": 4},
            "additional_config.balance_max_frozen_step",
            "balance_max_frozen_steps",
        ),
        (
            {"scheduler_config": {"enable_balance_scheduling": True, "balance_log_interval": 0}},
            "additional_config.scheduler_config.balance_log_interval",
            "balance_log_interval_s",
        ),
        # A typo of the enable key would leave balance silently off: refused too.
        (
            {"enable_balance_schedulling": True},
            "additional_config.enable_balance_schedulling",
            "enable_balance_scheduling",
        ),
    ],
)
def test_a_misspelled_key_is_refused_naming_the_closest_key_and_the_docs(
    additional_config, where, closest
):
    from vllm_balance.config import BalanceConfigError

    with pytest.raises(BalanceConfigError) as raised:
        _read(additional_config)
    message = str(raised.value)
    assert where in message and repr(closest) in message, message
    assert 'docs/operations.md, "Configuration keys"' in message
    assert "\n" not in message


def test_other_balance_named_keys_and_the_valid_ones_are_accepted():
    """vllm-ascend's own ``absolute_balance_threshold`` is not this package's key."""
    options = _read(
        {
            "enable_balance_scheduling": True,
            "absolute_balance_threshold": 3,
            "balance_max_frozen_steps": 4,
            "scheduler_config": {"balance_log_interval_s": 0},
        }
    )
    assert options is not None and options.max_frozen_steps == 4
    assert options.log_interval_s is None
