"""The one place that reads whether balance scheduling is enabled.

Sources, first match wins:
1. vllm-ascend's ``AscendConfig`` when that package is importable and initialised (on Ascend it is
   the primary source; vllm-ascend 0.27.1rc1 and 0.30.0rc2 no longer read the env var below, so
   where ``AscendConfig`` decides the env var is not read here either, with a warning saying so);
2. ``additional_config.scheduler_config.enable_balance_scheduling`` (the nested form newer
   vllm-ascend uses), which wins over
3. ``additional_config.enable_balance_scheduling``;
4. the deprecated env var ``VLLM_ASCEND_BALANCE_SCHEDULING``, parsed here and nowhere else,
   with a deprecation warning.

Values must be real booleans (JSON ``true``/``false``); anything else is a ``ValueError`` naming
the key and the value, because a silently ignored ``"yes"`` is an outage waiting to happen.
"""

from __future__ import annotations

import difflib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_balance.ascend import source as ascend_source
from vllm_balance.log import logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

ENABLE_KEY = "enable_balance_scheduling"
DEPRECATED_ENV_VAR = "VLLM_ASCEND_BALANCE_SCHEDULING"
_ENV_TRUE = {"1", "true"}
_ENV_FALSE = {"0", "false", ""}
_UNSET = object()
KEYS_DOCS = 'docs/operations.md, "Configuration keys"'


class BalanceConfigError(ValueError):
    """A configuration that enables balance scheduling but cannot honour it, or a key meant for
    this package that it does not define or a value it cannot take: one line that names the key
    and the fix."""


def _checked_bool(where: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise BalanceConfigError(
        f"{where} must be a boolean (JSON true or false), got {value!r} "
        f"of type {type(value).__name__}; see {KEYS_DOCS}"
    )


def _additional_config(vllm_config: VllmConfig) -> dict:
    additional = getattr(vllm_config, "additional_config", None) or {}
    if not isinstance(additional, dict):
        return {}
    return additional


def _from_ascend_config() -> Any:
    """vllm-ascend's parsed value, or _UNSET where vllm-ascend is absent or not initialised."""
    found, value = ascend_source.enable_value(ENABLE_KEY)
    return value if found else _UNSET


def additional_value(vllm_config: VllmConfig, key: str) -> tuple[str, Any]:
    """(where, value) of ``key``: the nested ``scheduler_config`` form wins over the top level."""
    additional = _additional_config(vllm_config)
    nested = additional.get("scheduler_config")
    if isinstance(nested, dict) and key in nested:
        return f"additional_config.scheduler_config.{key}", nested[key]
    return f"additional_config.{key}", additional.get(key, _UNSET)


def _from_additional_config(vllm_config: VllmConfig) -> Any:
    where, value = additional_value(vllm_config, ENABLE_KEY)
    return value if value is _UNSET else _checked_bool(where, value)


def _env_flag(name: str, hint: str = "") -> Any:
    """An environment variable holding 0/1/true/false as a bool; _UNSET when it is not set."""
    raw = os.environ.get(name)
    if raw is None:
        return _UNSET
    normalized = raw.strip().lower()
    if normalized not in _ENV_TRUE | _ENV_FALSE:
        raise ValueError(f"{name} must be 0/1/true/false, got {raw!r}{hint}")
    return normalized in _ENV_TRUE


def _from_deprecated_env() -> Any:
    value = _env_flag(DEPRECATED_ENV_VAR, f"; prefer additional_config.{ENABLE_KEY}")
    if value is not _UNSET:
        logger.warning_once(
            "%s is deprecated; use --additional-config '{\"%s\": true}' instead",
            DEPRECATED_ENV_VAR,
            ENABLE_KEY,
            scope="process",  # every engine process says it, as each reads the variable
        )
    return value


def balance_enabled(vllm_config: VllmConfig) -> bool:
    """Whether this config enables balance scheduling (see the module docstring);
    ``read_options``' first part."""
    value = _from_ascend_config()
    if value is not _UNSET:
        if os.environ.get(DEPRECATED_ENV_VAR) is not None:
            logger.warning_once(
                "%s is not read: vllm-ascend's AscendConfig decides (%s=%s; vllm-ascend "
                "0.27.1rc1 and later no longer read the variable); set "
                "additional_config.scheduler_config.%s instead",
                DEPRECATED_ENV_VAR,
                ENABLE_KEY,
                repr(value),  # the once-cache keys on the arguments: a str is hashable
                ENABLE_KEY,
                scope="process",
            )
        return _checked_bool(ENABLE_KEY, value)
    for source in (lambda: _from_additional_config(vllm_config), _from_deprecated_env):
        value = source()
        if value is not _UNSET:
            return _checked_bool(ENABLE_KEY, value)
    return False


def balance_mentioned(vllm_config: VllmConfig) -> bool:
    """Whether anything asks for balance scheduling, read without importing or initialising
    anything: vllm-ascend's AscendConfig where it is already imported and initialised, the key in
    ``additional_config`` (either form, any value but ``false``: a bad value is then refused by
    ``balance_enabled``), the deprecated env var (set, not false). False means balance is off:
    the engine-core wrapper passes straight through and nothing else is read or touched."""
    values = [additional_value(vllm_config, ENABLE_KEY)[1]]
    if "vllm_ascend.ascend_config" in sys.modules:
        values.append(_from_ascend_config())
    if any(value is not _UNSET and value is not False for value in values):
        return True
    raw = os.environ.get(DEPRECATED_ENV_VAR)
    return raw is not None and raw.strip().lower() not in _ENV_FALSE


# The API server decodes each engine's balance counters (registry.STATS_DECODED_WITH_BALANCE)
# only when asked: the plugin runs there before any config exists.
METRICS_ENV_VAR = "VLLM_BALANCE_METRICS"


def metrics_decoding_requested() -> bool:
    return _env_flag(METRICS_ENV_VAR) is True


LOG_INTERVAL_KEY = "balance_log_interval_s"
MAX_FROZEN_STEPS_KEY = "balance_max_frozen_steps"
TAKE_OVER_KEY = "balance_take_over_vllm_ascend"
TAKE_OVER_ENV_VAR = "VLLM_BALANCE_TAKE_OVER_VLLM_ASCEND"
GATHER_WARN_KEY = "balance_gather_warn_s"
COLLECTIVE_KEY = "balance_collective"
# The contract's all_gather (default), or the opt-in log-depth reduction (shim/collective.py).
ALL_GATHER = "all_gather"
RECURSIVE_DOUBLING = "recursive_doubling"
COLLECTIVES = (ALL_GATHER, RECURSIVE_DOUBLING)
DEFAULT_LOG_INTERVAL_S = 10.0
DEFAULT_GATHER_WARN_S = 5.0


_INVALID = object()


def _seconds(value: Any) -> Any:
    """A finite number of seconds >= 0; 0 means off (None)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0:
        return _INVALID
    return float(value) or None


def _bound(value: Any) -> Any:
    if value is None:
        return None
    whole = isinstance(value, int) and not isinstance(value, bool)
    return value if whole and value >= 1 else _INVALID


def _boolean(value: Any) -> Any:
    return value if isinstance(value, bool) else _INVALID


def _collective(value: Any) -> Any:
    return value if isinstance(value, str) and value in COLLECTIVES else _INVALID


@dataclass(frozen=True)
class TuningKey:
    """One tuning key of ``additional_config``: the ``BalanceOptions`` field it fills, what a
    value must be (the error's words), its parser (``_INVALID`` for a bad value) and the docs
    table's Type and Default cells, which tests/test_config.py checks against the table."""

    name: str
    field: str
    must_be: str
    parse: Callable[[Any], Any]
    type_cell: str
    default_cell: str


SECONDS = "a number of seconds >= 0"
TUNING_KEYS = (
    TuningKey(
        name=LOG_INTERVAL_KEY,
        field="log_interval_s",
        must_be=f"{SECONDS} (0 turns the log line off)",
        parse=_seconds,
        type_cell="number >= 0",
        default_cell="`10`",
    ),
    TuningKey(
        name=MAX_FROZEN_STEPS_KEY,
        field="max_frozen_steps",
        must_be="an integer >= 1 (or unset for no bound)",
        parse=_bound,
        type_cell="int >= 1",
        default_cell="unset",
    ),
    TuningKey(
        name=TAKE_OVER_KEY,
        field="take_over_vllm_ascend",
        must_be="a boolean (JSON true or false)",
        parse=_boolean,
        type_cell="bool",
        default_cell="`false`",
    ),
    TuningKey(
        name=GATHER_WARN_KEY,
        field="gather_warn_s",
        must_be=f"{SECONDS} (0 turns the gather watchdog off)",
        parse=_seconds,
        type_cell="number >= 0",
        default_cell="`5`",
    ),
    TuningKey(
        name=COLLECTIVE_KEY,
        field="collective",
        must_be=f"one of {', '.join(COLLECTIVES)}",
        parse=_collective,
        type_cell=" or ".join(f'`"{name}"`' for name in COLLECTIVES),
        default_cell=f'`"{ALL_GATHER}"`',
    ),
)
# The package's own additional_config keys besides the enable key, top level or nested under
# scheduler_config: the explicit list a host config that rejects unknown keys (vllm-ascend's
# AscendConfig, extra="forbid") accepts on this package's behalf while it is installed; a
# documented entry point (docs/operations.md, "Configuration keys"): any other balance_* key is a
# typo there.
BALANCE_KEYS = tuple(key.name for key in TUNING_KEYS)
KNOWN_KEYS = (ENABLE_KEY, *BALANCE_KEYS)


def _looks_like_ours(key: object) -> bool:
    """``balance_*`` is this package's prefix; a near-miss of the enable key is a typo of it.
    Other ``*balance*`` keys are left alone (vllm-ascend has ``absolute_balance_threshold``)."""
    if not isinstance(key, str):
        return False
    return key.startswith("balance_") or bool(difflib.get_close_matches(key, [ENABLE_KEY], 1, 0.9))


def refuse_unknown_keys(vllm_config: VllmConfig) -> None:
    """Raise ``BalanceConfigError`` for a misspelled key of this package, top level or nested:
    ignored, ``balance_max_frozen_step`` would silently leave the hold unbounded."""
    additional = _additional_config(vllm_config)
    nested = additional.get("scheduler_config")
    places = [("additional_config", additional)]
    if isinstance(nested, dict):
        places.append(("additional_config.scheduler_config", nested))
    for where, keys in places:
        for key in keys:
            if _looks_like_ours(key) and key not in KNOWN_KEYS:
                close = difflib.get_close_matches(key, KNOWN_KEYS, 1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise BalanceConfigError(
                    f"{where}.{key} is not a balance scheduling key; {hint}see {KEYS_DOCS}"
                )


@dataclass(frozen=True)
class BalanceOptions:
    """Tuning keys, read from additional_config like the enable key (nested form wins)."""

    # Seconds between the per-rank log lines; None turns the line off (key set to 0).
    log_interval_s: float | None = DEFAULT_LOG_INTERVAL_S
    # Opt-in bounded hold: after this many consecutive frozen steps admission opens for one
    # step on all ranks. None (the default) is exactly the contract: no bound.
    max_frozen_steps: int | None = None
    # Opt-in take-over: where vllm-ascend's own balance patch is active, restore the vLLM names
    # it replaced and run this package instead (vllm_balance.ascend.takeover). Off: step aside.
    # The key, else the environment variable (vllm-ascend >= 0.27.1rc1 refuses unknown keys).
    take_over_vllm_ascend: bool = False
    # Seconds one gather may wait before the gather watchdog logs an error; None turns the
    # watchdog off (key set to 0).
    gather_warn_s: float | None = DEFAULT_GATHER_WARN_S
    # The per-step collective: the contract's all_gather of every rank's count, or the opt-in
    # log2-depth reduction of max/min/sum (docs/scaling.md; the gate decision is the same).
    collective: str = ALL_GATHER


def _take_over_from_env() -> bool:
    """``VLLM_BALANCE_TAKE_OVER_VLLM_ASCEND``: the take-over opt-in where the key cannot be used.

    vllm-ascend 0.27.1rc1 and later validate ``additional_config`` with ``extra="forbid"``: any
    key it does not know, this package's included, fails its ``init_ascend_config`` at start-up.
    """
    value = _env_flag(TAKE_OVER_ENV_VAR)
    return False if value is _UNSET else value


def balance_options(vllm_config: VllmConfig) -> BalanceOptions:
    """The tuning keys, each checked (``read_options``' second part, after the enable key)."""
    values: dict[str, Any] = {}
    for key in TUNING_KEYS:
        where, value = additional_value(vllm_config, key.name)
        if value is _UNSET:
            continue
        parsed = key.parse(value)
        if parsed is _INVALID:
            raise BalanceConfigError(
                f"{where} must be {key.must_be}, got {value!r}; see {KEYS_DOCS}"
            )
        values[key.field] = parsed
    if "take_over_vllm_ascend" not in values:  # the environment only where the key is unset
        values["take_over_vllm_ascend"] = _take_over_from_env()
    return BalanceOptions(**values)


def read_options(vllm_config: VllmConfig) -> BalanceOptions | None:
    """This config's options where it enables balance scheduling, else None (keys then unread).

    The one reader of a ``VllmConfig``: the activation, the balance scheduler and the API
    server's stat logger each call it with the config they are given. A misspelled key of this
    package is refused first, also where balance is off (a typo of the enable key leaves it off).
    It changes nothing; its
    warnings print once per process (vLLM's ``warning_once``), however often a process reads.
    """
    refuse_unknown_keys(vllm_config)
    return balance_options(vllm_config) if balance_enabled(vllm_config) else None
