"""Step-time model of one lock-stepped MoE forward across DP ranks.

In DP attention + expert-parallel MoE serving every rank joins the same all-to-all dispatch and
combine on every layer, so no rank starts step k+1 before the slowest rank finished step k. The
cluster's step time is therefore the maximum of the ranks' times, and a rank with nothing to do
still runs a dummy batch (vLLM's ``execute_dummy_batch``) and pays the fixed overhead.

A rank's time is linear in what it scheduled::

    fixed_ms + per_prefill_token_ms * prefill_tokens
             + per_decode_request_ms * decode_requests
             + per_kv_token_ms * kv_tokens_of_decode_requests

Default values and their source
-------------------------------
DeepSeek's "Day 6: DeepSeek-V3/R1 Inference System Overview" (deepseek-ai/open-infra-index,
2025-02-28) reports, per H800 node (8 GPUs, one DP rank each): ~73.7k input tokens/s during
prefill (cache hits included) and ~14.8k output tokens/s during decode, at an average output
speed of 20-22 tokens/s per request. Per rank that is 9.2k prefill tokens/s
(``per_prefill_token_ms = 1000 / 9200 ~ 0.11``) and 1850 decode tokens/s; at ~21 tokens/s per
request a decode step is ~47.6 ms with ~88 requests per rank. The split of those 47.6 ms into a
fixed part and a per-request part is our assumption, not DeepSeek's: 20 ms fixed (dispatch and
combine latency and launch floor, which do not shrink with the batch) and
``(47.6 - 20) / 88 ~ 0.31`` ms per decode request. The KV term is off by default (attention cost
per context token depends on kernels and context length that the publication does not give).

These are coarse; they fix the ratio of prefill to decode cost, which is what decides how much
an admission burst on one rank stalls everyone. Override any of them from a JSON or TOML file
(``--step-model FILE``) with the keys of :class:`StepTimeModel`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StepTimeModel:
    fixed_ms: float = 20.0
    per_prefill_token_ms: float = 0.11
    per_decode_request_ms: float = 0.31
    per_kv_token_ms: float = 0.0

    def rank_time_ms(self, prefill_tokens: int, decode_requests: int, kv_tokens: int = 0) -> float:
        return (
            self.fixed_ms
            + self.per_prefill_token_ms * prefill_tokens
            + self.per_decode_request_ms * decode_requests
            + self.per_kv_token_ms * kv_tokens
        )

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class StepModelError(ValueError):
    """A step-model file that cannot be used; the message names the file and the key."""


def _parse_file(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError as exc:  # Python 3.10 has no tomllib
            raise StepModelError(f"{path}: TOML needs Python 3.11+; use a JSON file") from exc
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise StepModelError(f"{path}: not valid TOML ({exc})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StepModelError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise StepModelError(f"{path}: expected an object of step-model keys")
    return data


def load_step_model(path: str | Path) -> StepTimeModel:
    """Defaults overridden by the keys present in ``path`` (.json or .toml)."""
    path = Path(path)
    data = _parse_file(path)
    known = {field.name for field in dataclasses.fields(StepTimeModel)}
    values: dict[str, float] = {}
    for key, value in data.items():
        if key not in known:
            raise StepModelError(f"{path}: unknown key {key!r}; known keys: {sorted(known)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise StepModelError(f"{path}: key {key!r} must be a number >= 0, got {value!r}")
        values[key] = float(value)
    return StepTimeModel(**values)
