"""Per-step timing of each engine core (observation only; for ``nox -s bench-serve``).

When ``VLLM_BALANCE_E2E_STEP_DIR`` is set, every engine-core process appends one JSON line per
busy-loop engine step to ``<dir>/steps-<pid>.jsonl``: when ``_process_engine_step()`` began
(``t``, monotonic s, one clock for all processes of the machine), how long it took (``ms``:
schedule, the forward through the worker, ``update_from_output``), and what the step ran
(``prefill_tokens``, ``prefill_reqs``, ``decode_reqs``, ``kv_tokens``: context tokens of the
decode requests). The time from one line's ``t`` to the next one's of the same rank is the whole
busy-loop iteration, the DP all-reduce and (balance on) the balance gather included: that
difference, balance on vs off, is the gather's real cost per step. Steps that ran nothing
(dummy batches) are lines with ``executed: false``.

Why these two methods: the busy loop looks ``_process_engine_step`` up on every iteration, and
``update_from_output`` on the scheduler instance, so class-level wrappers installed when the
engine core loads its plugins (``EngineCore.__init__``) see every step, whichever scheduler or
engine-core subclass balance installs (neither overrides them).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STEP_DIR_ENV = "VLLM_BALANCE_E2E_STEP_DIR"
_state: dict = {}


def step_work(scheduler_output, requests) -> dict[str, int]:
    """Prefill tokens and requests, decode requests and their context tokens of one step."""
    new = {r.req_id for r in scheduler_output.scheduled_new_reqs}
    work = {"prefill_tokens": 0, "prefill_reqs": 0, "decode_reqs": 0, "kv_tokens": 0}
    for req_id, tokens in scheduler_output.num_scheduled_tokens.items():
        if req_id in new or tokens > 1:
            work["prefill_tokens"] += tokens
            work["prefill_reqs"] += 1
        else:
            work["decode_reqs"] += 1
            request = requests.get(req_id)
            work["kv_tokens"] += request.num_computed_tokens if request is not None else 0
    return work


def install(directory: Path) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCoreProc

    out = open(directory / f"steps-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
    _state["out"] = out
    original_step = EngineCoreProc._process_engine_step
    original_update = Scheduler.update_from_output

    def update_from_output(self, scheduler_output, model_runner_output):
        _state["work"] = step_work(scheduler_output, self.requests)
        return original_update(self, scheduler_output, model_runner_output)

    def _process_engine_step(self):
        _state["work"] = None
        began = time.monotonic()
        executed = original_step(self)
        ms = (time.monotonic() - began) * 1000.0
        rank = self.vllm_config.parallel_config.data_parallel_rank
        record = {"rank": rank, "t": round(began, 6), "ms": round(ms, 3), "executed": executed}
        record.update(_state["work"] or {})
        out.write(json.dumps(record) + "\n")
        return executed

    Scheduler.update_from_output = update_from_output
    EngineCoreProc._process_engine_step = _process_engine_step


def register() -> None:
    directory = os.environ.get(STEP_DIR_ENV)
    if not directory or _state:
        return
    # Only engine cores step; the front end and workers load the same plugins and are skipped.
    import multiprocessing

    if not multiprocessing.current_process().name.startswith("EngineCore"):
        return
    install(Path(directory))
