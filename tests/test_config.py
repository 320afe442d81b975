"""Reading the enable key: one place, nested wins, booleans only, env var deprecated."""

from __future__ import annotations

import logging
import types

import pytest

from vllm_balance.config import DEPRECATED_ENV_VAR, balance_enabled


def config_with(additional_config):
    # balance_enabled reads only .additional_config; a real VllmConfig is covered in
    # test_activation.py, this isolates the parsing rules.
    return types.SimpleNamespace(additional_config=additional_config)


@pytest.mark.parametrize(
    "additional_config, expected",
    [
        (None, False),
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
    assert balance_enabled(config_with(additional_config)) is expected


@pytest.mark.parametrize("value", ["yes", "true", 1, 1.5, ["true"], None])
def test_non_boolean_value_is_a_clear_error_naming_key_and_value(value):
    with pytest.raises(ValueError) as excinfo:
        balance_enabled(config_with({"enable_balance_scheduling": value}))
    assert str(excinfo.value) == (
        f"additional_config.enable_balance_scheduling must be a boolean (JSON true or false), "
        f"got {value!r} of type {type(value).__name__}"
    )


def test_non_boolean_nested_value_names_the_nested_key():
    with pytest.raises(ValueError, match=r"additional_config\.scheduler_config\.enable_balance"):
        balance_enabled(config_with({"scheduler_config": {"enable_balance_scheduling": "on"}}))


def test_deprecated_env_var_enables_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(DEPRECATED_ENV_VAR, "1")
    with caplog.at_level(logging.WARNING, logger="vllm_balance"):
        assert balance_enabled(config_with({})) is True
    assert f"{DEPRECATED_ENV_VAR} is deprecated" in caplog.text


def test_additional_config_wins_over_deprecated_env_var(monkeypatch, caplog):
    monkeypatch.setenv(DEPRECATED_ENV_VAR, "1")
    with caplog.at_level(logging.WARNING, logger="vllm_balance"):
        assert balance_enabled(config_with({"enable_balance_scheduling": False})) is False
    assert "deprecated" not in caplog.text  # never parsed when the key is set


def test_bad_deprecated_env_var_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(DEPRECATED_ENV_VAR, "maybe")
    with pytest.raises(
        ValueError, match=f"{DEPRECATED_ENV_VAR} must be 0/1/true/false, got 'maybe'"
    ):
        balance_enabled(config_with({}))


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
