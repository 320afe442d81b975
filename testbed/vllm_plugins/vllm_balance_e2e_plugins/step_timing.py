"""Per-step timing of each engine core (observation only; for ``nox -s bench-serve``).

When ``VLLM_BALANCE_E2E_STEP_DIR`` is set, every engine-core process appends one JSON line per
busy-loop engine step to ``<dir>/steps-<pid>.jsonl``: when ``_process_engine_step()`` began
(``t``, monotonic s, one clock for all processes of the machine), how long it took (``ms``:
schedule, the forward through the worker, ``update_from_output``), and what the step ran
(``prefill_tokens``, ``prefill_reqs``, ``decode_reqs``, ``kv_tokens``: context tokens of the
decode requests). The time from one line's ``t`` to the next one's of the same rank is the whole
busy-loop iteration, the DP all-reduce and (balance on) the balance gather included: that
difference, balance on vs off, is the gather's real cost per step. Steps that ran nothing
(dummy batches) are lines with ``executed: false``. Each line also carries what the rank held
after the step (``running``: ``len(scheduler.running)``; ``frozen``: the balance gate's
``frozen``, only on steps whose ``schedule()`` ran, i.e. the rank had requests; absent
with balance off) and two cumulative clocks of the rank read when the step began: ``cpu_s``
(CPU seconds of the engine core and its worker process, all threads) and ``device_ms`` (device
time emulated so far, booked by ``device_time``; 0 without emulation): one line's value
subtracted from the next one's is the iteration's CPU time and emulated device time, as ``t``
gives its period.

With balance on, a step whose ``schedule()`` ran also says which gathered vector its gate read
(``gather``: the rank's count of gathers before the step; every rank gathers once per active
step, so the same number is the same collective on every rank): ranks that read the same vector
must decide alike, ``frozen`` (tests/e2e/test_multinode.py).

Why these two methods: the busy loop looks ``_process_engine_step`` up on every iteration, and
``update_from_output`` on the scheduler instance, so class-level wrappers installed when the
engine core loads its plugins (``EngineCore.__init__``) see every step, whichever scheduler or
engine-core subclass balance installs (neither overrides them).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

STEP_DIR_ENV = "VLLM_BALANCE_E2E_STEP_DIR"
_state: dict = {}
# Device time emulated so far in this process, ms (``device_time`` adds each forward's sleep).
EMULATED = {"device_ms": 0.0}


def step_work(scheduler_output, context_tokens: Mapping[str, int]) -> dict[str, int]:
    """Prefill tokens and requests, decode requests and their context tokens of one step.

    ``context_tokens``: each decode request's context after this step (requests absent count 0).
    """
    new = {r.req_id for r in scheduler_output.scheduled_new_reqs}
    work = {"prefill_tokens": 0, "prefill_reqs": 0, "decode_reqs": 0, "kv_tokens": 0}
    for req_id, tokens in scheduler_output.num_scheduled_tokens.items():
        if req_id in new or tokens > 1:
            work["prefill_tokens"] += tokens
            work["prefill_reqs"] += 1
        else:
            work["decode_reqs"] += 1
            work["kv_tokens"] += context_tokens.get(req_id, 0)
    return work


def rank_cpu_s() -> float:
    """CPU seconds of this engine core and its worker so far (the rank's host CPU).

    The worker is a child process (vLLM's multiproc executor), found once: it lives as long as
    the engine core. Its clock ticks every 10 ms (/proc), so a single step's share is coarse;
    the benchmark sums it over runs.
    """
    import psutil

    if "children" not in _state:
        _state["children"] = psutil.Process().children()
    total = time.process_time()
    for child in _state["children"]:
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def install(directory: Path) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCoreProc

    out = open(directory / f"steps-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
    _state["out"] = out
    original_update = Scheduler.update_from_output

    def update_from_output(self, scheduler_output, model_runner_output):
        requests = self.requests
        context = {r: requests[r].num_computed_tokens for r in scheduler_output.num_scheduled_tokens
                   if r in requests}  # fmt: skip
        _state["work"] = step_work(scheduler_output, context)
        return original_update(self, scheduler_output, model_runner_output)

    def timed(original_step):
        def _process_engine_step(self):
            return _timed_step(self, original_step, out)

        return _process_engine_step

    Scheduler.update_from_output = update_from_output
    EngineCoreProc._process_engine_step = timed(EngineCoreProc._process_engine_step)
    # A Ray engine-core actor's class (ray.remote's subclass) holds its own wrapped copy of every
    # method, made in the API server: the wrapper on EngineCoreProc does not reach it.
    for cls in _subclasses(EngineCoreProc):
        if "__ray_actor_class__" in vars(cls) and "_process_engine_step" in vars(cls):
            cls._process_engine_step = timed(vars(cls)["_process_engine_step"])


def _subclasses(cls: type):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _timed_step(self, original_step, out) -> bool:
    """One busy-loop step of an engine core, run and recorded."""
    _state["work"] = None
    gate = getattr(self.scheduler, "balance_gate", None)
    balance = None if gate is None else gate.stats
    gathers, steps_before = (balance.gathers, balance.steps) if balance else (None, None)
    began, cpu_s, device_ms = time.monotonic(), rank_cpu_s(), EMULATED["device_ms"]
    scheduled = self.scheduler.has_requests()  # step() calls schedule() only then
    executed = original_step(self)
    ms = (time.monotonic() - began) * 1000.0
    rank = self.vllm_config.parallel_config.data_parallel_rank
    record = {"rank": rank, "t": round(began, 6), "ms": round(ms, 3), "executed": executed}
    if balance is not None and balance.steps > steps_before:  # schedule() ran this step
        record.update(gather=gathers, frozen=gate.frozen)
    record.update(_state["work"] or {})
    record.update(cpu_s=round(cpu_s, 6), device_ms=round(device_ms, 3))
    record["running"] = len(self.scheduler.running)
    if scheduled and gate is not None:
        record["frozen"] = gate.frozen
    out.write(json.dumps(record) + "\n")
    return executed


def register() -> None:
    directory = os.environ.get(STEP_DIR_ENV)
    if not directory or _state:
        return
    # Only engine cores step; the front end and workers load the same plugins and are skipped.
    if not _is_engine_core():
        return
    install(Path(directory))


def _is_engine_core() -> bool:
    """vLLM's launcher names the process EngineCore_DP<r>; a Ray engine-core actor's title (Ray
    sets it) is ``ray::<actor class>``, a class named ...EngineCoreActor."""
    import multiprocessing

    if multiprocessing.current_process().name.startswith("EngineCore"):
        return True
    title = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0]
    return title.startswith(b"ray::") and b"EngineCoreActor" in title
