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

Shared expert work (``shared_fraction``)
----------------------------------------
"The slowest rank decides" holds for the work a rank does on its own tokens (attention, KV
reads, the shared expert, norms). The routed experts are different: with expert parallelism a
rank's tokens are dispatched to the ranks that hold their experts, so a prefill burst on one rank
becomes expert work on *all* ranks. ``shared_fraction`` (0..1) is the part of the per-token
prefill and per-request decode cost that behaves this way: it is charged once per step as the
cluster-wide sum divided by DP, the rest stays per rank (``fixed_ms`` and the KV term stay per
rank), and the step is the slowest rank's own part plus the shared part::

    own(r)  = fixed_ms + (1 - s) * (prefill_r + decode_r) + kv_r
    shared  = s * sum_r(prefill_r + decode_r) / DP
    step    = max_r own(r) + shared

The larger ``s``, the less a burst on one rank stalls the others, and the less there is for the
gate to save. Default 0: every rank's work is its own, the model every earlier result in
docs/results.md used, and ``0`` reproduces those numbers exactly (a test pins it byte for byte).
It is not a claim about a real deployment: DeepSeek-V3's routed experts are ~55% of its activated
parameters (8 of 9 experts in 58 of 61 layers), so a compute-bound prefill on an EP deployment
sits nearer 0.5. docs/results.md's operating envelope shows the answer over the whole range;
set your own in the step-model file.

The gather's own cost (``gather_ms``)
-------------------------------------
Balance adds one ``all_gather`` on the gloo DP group per active step (contract 3), after the
step's outputs are sent and before the next step starts. The simulator charges it to every step
of a policy that gathers (``on``, ``cap-1``, ``bounded-hold``, ``trtllm-adp``), so balance is
never free. Default 0.64 ms: ``balance_gather()`` at DP=2 on gloo loopback, the mean of the two
runs in docs/results.md "(b) Gather cost" (651 and 621 us), the only measured point not
oversubscribed on the 2-core machine. ``0`` charges nothing.

A cluster's gather crosses the network and grows with DP (docs/scaling.md). gloo's
``all_gather`` is a ring: ``gloo::allgather`` (gloo/allgather.cc) passes each rank's value to
its neighbour DP-1 times in sequence, so its latency is a fixed part plus DP-1 network hops.
``gather_hop_us`` is that per-hop latency (µs; one small TCP message between two DP ranks' hosts)
and :meth:`StepTimeModel.gather_cost_ms` charges ``gather_ms + (DP - 1) * gather_hop_us / 1000``:
``gather_ms`` then stands for the fixed part. Default 0, the constant gather every earlier
result used, to the last bit.

``gather_collective`` (default ``"all_gather"``) is the engine's ``balance_collective``: with
``"recursive_doubling"`` the hops are the log-depth reduction's (``vllm_balance.shim.collective``):
log2 of the largest power of two <= DP, plus 2 where DP is not a power of two (the extra ranks
fold in and get the result back), e.g. 3 at DP=8, 8 at DP=256, 3 at DP=3 (the ring: 2).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def ring_allgather_hops(dp_size: int) -> int:
    """Sequential network hops of gloo's ``allgather`` (a ring) over ``dp_size`` ranks."""
    return dp_size - 1


def recursive_doubling_hops(dp_size: int) -> int:
    """Sequential hops of ``balance_collective: "recursive_doubling"`` over ``dp_size`` ranks."""
    core = 1 << (dp_size.bit_length() - 1)
    return core.bit_length() - 1 + (2 if dp_size > core else 0)


GATHER_HOPS = {"all_gather": ring_allgather_hops, "recursive_doubling": recursive_doubling_hops}


@dataclass(frozen=True)
class RankWork:
    """What one rank's ``schedule()`` gave its forward (all zero for a dummy batch)."""

    prefill_tokens: int = 0
    decode_requests: int = 0
    kv_tokens: int = 0


@dataclass(frozen=True)
class StepTimeModel:
    fixed_ms: float = 20.0
    per_prefill_token_ms: float = 0.11
    per_decode_request_ms: float = 0.31
    per_kv_token_ms: float = 0.0
    shared_fraction: float = 0.0
    gather_ms: float = 0.64
    gather_hop_us: float = 0.0
    gather_collective: str = "all_gather"

    def rank_time_ms(self, prefill_tokens: int, decode_requests: int, kv_tokens: int = 0) -> float:
        """One rank's own part of the step (its full time when ``shared_fraction`` is 0)."""
        own = 1.0 - self.shared_fraction  # exactly 1.0 at 0: the products below are unchanged
        return (
            self.fixed_ms
            + own * self.per_prefill_token_ms * prefill_tokens
            + own * self.per_decode_request_ms * decode_requests
            + self.per_kv_token_ms * kv_tokens
        )

    def shared_time_ms(self, prefill_tokens: int, decode_requests: int, dp_size: int) -> float:
        """The cluster-shared part for the cluster-wide totals, spread over ``dp_size`` ranks."""
        work = self.per_prefill_token_ms * prefill_tokens
        work += self.per_decode_request_ms * decode_requests
        return self.shared_fraction * work / dp_size

    def step_time_ms(self, works: Sequence[RankWork]) -> float:
        """The lockstep step: the slowest rank's own part plus the shared part (ms)."""
        slowest = max(
            self.rank_time_ms(w.prefill_tokens, w.decode_requests, w.kv_tokens) for w in works
        )
        shared = self.shared_time_ms(
            sum(w.prefill_tokens for w in works), sum(w.decode_requests for w in works), len(works)
        )
        return slowest + shared  # + 0.0 when shared_fraction is 0: today's numbers, bit for bit

    def gather_cost_ms(self, dp_size: int) -> float:
        """The balance ``all_gather``'s own time per active step at ``dp_size`` ranks (ms).

        gloo's ring ``all_gather``: the fixed part plus ``dp_size - 1`` sequential hops; the
        log-depth reduction (``gather_collective``): ``recursive_doubling_hops(dp_size)``.
        """
        if not self.gather_hop_us:
            return self.gather_ms  # the constant model: no float arithmetic, bit for bit
        hops = GATHER_HOPS[self.gather_collective](dp_size)
        return self.gather_ms + hops * self.gather_hop_us / 1000.0

    def to_dict(self) -> dict[str, float | str]:
        return dataclasses.asdict(self)


class StepModelError(ValueError):
    """A step-model file that cannot be used; the message names the file and the key."""


def _parse_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise StepModelError(f"{path}: cannot read the step-model file ({exc.strerror})") from exc
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


def step_model_keys(path: str | Path) -> frozenset[str]:
    """The keys a step-model file sets; every other key keeps its default (``advise`` varies a
    term over its whole range where the file leaves it at the default)."""
    return frozenset(_parse_file(Path(path)))


def load_step_model(path: str | Path) -> StepTimeModel:
    """Defaults overridden by the keys present in ``path`` (.json or .toml)."""
    path = Path(path)
    data = _parse_file(path)
    known = {field.name for field in dataclasses.fields(StepTimeModel)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise StepModelError(f"{path}: unknown key {key!r}; known keys: {sorted(known)}")
        if key == "gather_collective":
            if not isinstance(value, str) or value not in GATHER_HOPS:
                raise StepModelError(
                    f"{path}: key {key!r} must be one of {', '.join(GATHER_HOPS)}, got {value!r}"
                )
            values[key] = value
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < 0:
            raise StepModelError(f"{path}: key {key!r} must be a number >= 0, got {value!r}")
        if key == "shared_fraction" and value > 1:
            raise StepModelError(f"{path}: key {key!r} must be between 0 and 1, got {value!r}")
        values[key] = float(value)
    return StepTimeModel(**values)
