"""Test support: real vLLM objects, stepped and compared (as vLLM's tests/v1/core/utils.py).

The objects themselves (``VllmConfig``, ``Scheduler``, ``Request``, the fabricated
``ModelRunnerOutput``) come from :mod:`balance_sim.builders`, which the simulator runs on;
this module adds what only tests need: request batches, stepping a scheduler to completion and
a comparable rendering of its outputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from balance_sim.builders import (  # noqa: F401  (re-exported: tests import them from here)
    BLOCK_SIZE,
    RequestSpec,
    block_hasher,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_runner_output,
    prompt_token_ids,
    tiny_model_dir,
)


def request_specs(
    n: int,
    prompt_len: int = 32,
    max_tokens: int = 8,
    prefix: str = "req",
    shared_prefix: Sequence[int] = (),
    start: int = 0,
) -> list[RequestSpec]:
    """``n`` request specs with distinct prompts (after an optional shared prefix)."""
    specs = []
    for i in range(start, start + n):
        body = prompt_token_ids(i, prompt_len - len(shared_prefix))
        specs.append(
            RequestSpec(
                request_id=f"{prefix}-{i}",
                prompt_token_ids=tuple(shared_prefix) + tuple(body),
                max_tokens=max_tokens,
                arrival_time=float(i),
            )
        )
    return specs


def make_requests(n: int, **kwargs) -> list:
    return [make_request(spec) for spec in request_specs(n, **kwargs)]


def step(scheduler, token_id: int = 7):
    """One engine step: schedule, fabricate the forward, feed it back. Returns both outputs."""
    scheduler_output = scheduler.schedule()
    runner_output = model_runner_output(scheduler_output, scheduler, token_id)
    engine_outputs = scheduler.update_from_output(scheduler_output, runner_output)
    return scheduler_output, engine_outputs


def run_to_completion(scheduler, max_steps: int = 10_000) -> int:
    """Step until the scheduler has no unfinished requests; returns the number of steps."""
    steps = 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"scheduler did not drain in {max_steps} steps")
    return steps


def add_requests(scheduler, requests: Iterable) -> None:
    for request in requests:
        scheduler.add_request(request)


def describe(value: Any) -> Any:
    """A plain, comparable rendering of a vLLM output object (dataclasses, sets, tensors).

    Two ``SchedulerOutput``s are "the same output" when ``first_difference`` finds nothing: same
    scheduled / preempted / resumed sets, ``num_scheduled_tokens`` (in vLLM's order), block ids,
    finished ids and connector metadata. Objects without structure (e.g. ``SamplingParams``)
    compare by ``repr``; one whose repr is its identity fails loudly.
    """
    import dataclasses

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: describe(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not f.name.startswith("_")
        }
    if isinstance(value, dict):  # insertion order kept: first_difference compares it
        return {str(k): describe(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((describe(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    text = repr(value)
    # An identity-based repr would make equal objects differ; fail loudly instead of flaking.
    assert " at 0x" not in text, f"cannot compare {type(value).__name__} by value"
    return text


def first_difference(left: Any, right: Any, path: str = "") -> str | None:
    """The first field where two descriptions differ, as ``path: left != right``; None if equal."""
    if isinstance(left, dict) and isinstance(right, dict):
        for key in [*left, *(k for k in right if k not in left)]:
            if key not in left or key not in right:
                return f"{path}.{key}: present on one side only"
            found = first_difference(left[key], right[key], f"{path}.{key}")
            if found:
                return found
        # Same items: vLLM's own order (e.g. of num_scheduled_tokens) must match too.
        return None if list(left) == list(right) else f"{path}: order {list(left)} != {list(right)}"
    if isinstance(left, list) and isinstance(right, list) and len(left) == len(right):
        for i, (a, b) in enumerate(zip(left, right)):
            found = first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if left == right else f"{path or '<root>'}: {left!r} != {right!r}"


# -- trace and compare: the one observation both differential engines make per step ------------

# Shared prompt prefixes, whole blocks so the prefix cache can hit them; index 0 is "none".
SHARED_PREFIXES: tuple[tuple[int, ...], ...] = (
    (),
    tuple(range(900, 900 + 2 * BLOCK_SIZE)),
    tuple(range(600, 600 + 3 * BLOCK_SIZE)),
)
# Upstream's waiting queues differ between releases (0.31 dropped ``skipped_waiting`` and added
# ``kv_holding_waiting``); every one the installed release has is observed.
WAITING_QUEUES = ("waiting", "skipped_waiting", "kv_holding_waiting")


class Divergence(AssertionError):
    """Two schedulers disagreed; the message names the first step and field that differ."""


def engine_outputs(outputs: dict) -> list:
    """The request outputs of ``update_from_output`` (timestamps differ between any two runs)."""
    return [
        (client, o.request_id, list(o.new_token_ids), str(o.finish_reason))
        for client, batch in sorted(outputs.items())
        for o in batch.outputs
    ]


def observe(scheduler, output, outputs: dict) -> dict:
    """Everything compared after a step: the full SchedulerOutput, request outputs, queues."""
    return {
        "output": describe(output),
        "engine_outputs": engine_outputs(outputs),
        "queues": {
            "running": [r.request_id for r in scheduler.running],
            **{
                name: [r.request_id for r in getattr(scheduler, name)]
                for name in WAITING_QUEUES
                if hasattr(scheduler, name)
            },
            "deferred": sorted(r.request_id for r in getattr(scheduler, "deferred_waiting", ())),
            "finished": sorted(scheduler.finished_req_ids),
            "progress": sorted(
                (rid, r.num_computed_tokens, r.num_output_tokens, r.status.name)
                for rid, r in scheduler.requests.items()
            ),
            "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
        },
    }


def observation_difference(observed: dict, expected: dict) -> str | None:
    """The first difference between two ``observe()`` results, the SchedulerOutput first (it
    names the decision that differs); None if equal."""
    for part in observed:
        found = first_difference(observed[part], expected[part], part)
        if found:
            return found
    return None


def gate_read(scheduler) -> list[int]:
    """What the scheduler's gate reads now: the last gathered vector (zeros before the first
    gather on a group), or under the reduction its largest count alone."""
    gate = scheduler.balance_gate
    if not gate.all_gather:
        return [gate.leader]
    return list(gate.stats.last_gathered) or [0] * gate.dp_size
