"""Device-time emulation: each DP rank's forward takes the accelerator time of its own batch.

For ``nox -s bench-emulated``. When ``VLLM_BALANCE_E2E_DEVICE_MODEL`` names a
step-model file (the simulator's keys: ``balance_sim.stepmodel``), every engine core's
worker sleeps, before each forward, the time that model gives for the batch this rank runs:
``fixed_ms + per_prefill_token_ms * prefill tokens + per_decode_request_ms * decode requests +
per_kv_token_ms * their context tokens`` (``StepTimeModel.rank_time_ms``, the simulator's own
arithmetic). A drained rank's dummy batch sleeps ``fixed_ms``, as the simulator charges it. The
tiny model's real forward, its real MoE collectives and everything around them (API server, DP
coordinator, load balancer, engine cores, the balance gather and gate) run as they are; only the
accelerator's time is stood in for. Sleeping frees the core, so 4 or 8 ranks on 2 cores overlap
in wall time as ranks on their own devices do, as long as their CPU work stays well under the
emulated time (``benchmarks/emulated.py`` measures that per run and rejects runs where it does
not). The engine core books the same times for its step records (``install_booking``).

- **Why before the forward, not after it.** The simulator's step is the slowest rank's time for
  every rank (lockstep: no rank leaves a layer's dispatch/combine before the slowest arrives).
  Sleeping at the start of the worker's ``execute_model`` puts every rank's device time before
  this step's first DP collective (the MoE layers' ``all_gatherv``, and any batch-size sync
  before them), so that collective releases all ranks together when the slowest rank's sleep
  ends, and every rank returns its tokens at the same moment. Sleeping after the forward's
  collectives would let a rank with a short batch return its tokens (first tokens: TTFT) up to
  the difference earlier than the slowest rank, and only the next step's collective would hold
  it back: the period would still be the maximum, but the token times would not be the
  simulator's.
- **Why a sleep and not a busy wait.** A busy wait would hold a core for the whole emulated time;
  with 8 ranks on 2 cores the ranks would take turns and the "device" time would add up across
  ranks instead of overlapping.
- **Why the worker's own view of the batch.** The worker gets exactly what the rank's
  ``schedule()`` produced (``SchedulerOutput``); the work is read from it with the same rule the
  step records use (``step_timing.step_work``: a new request or more than one token is prefill).

``shared_fraction`` must be 0: the shared part of the simulator's step depends on every rank's
batch, which no rank sees. The gather's cost is not emulated (``gather_ms`` is ignored): the real
gather runs, and the benchmark measures what it costs.

Test support only: production runs on the accelerator, whose time this stands in for.
"""

from __future__ import annotations

import logging
import os
import time

from .step_timing import EMULATED, step_work

DEVICE_MODEL_ENV = "VLLM_BALANCE_E2E_DEVICE_MODEL"
logger = logging.getLogger("vllm.balance_e2e.device_time")
_installed: list = []


def load_device_model(path):
    """The step model from ``path``; refused where one rank cannot compute its own time."""
    from balance_sim.stepmodel import StepModelError, load_step_model

    model = load_step_model(path)
    if model.shared_fraction:
        raise StepModelError(
            f"{path}: shared_fraction {model.shared_fraction:g}: the device-time emulation "
            "needs 0 (the shared part depends on every rank's batch; a rank sees only its own)"
        )
    return model


def context_tokens(scheduler_output):
    """Context tokens after this step of each already-running request in ``scheduler_output``
    (the simulator's ``kv_tokens``: ``num_computed_tokens`` once this step's tokens are in)."""
    cached = scheduler_output.scheduled_cached_reqs
    scheduled = scheduler_output.num_scheduled_tokens
    return {
        req_id: computed + scheduled.get(req_id, 0)
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens)
    }


def batch_ms(model, scheduler_output) -> float:
    """Emulated device time of one rank's forward of ``scheduler_output`` (ms).

    0 when nothing is scheduled: the model runner then returns without a forward (a rank whose
    requests just finished steps once to tell its worker); the busy loop's dummy batch that
    follows is the forward, and sleeps ``fixed_ms``, as the simulator charges such a rank once.
    """
    if not scheduler_output.total_num_scheduled_tokens:
        return 0.0
    work = step_work(scheduler_output, context_tokens(scheduler_output))
    return model.rank_time_ms(work["prefill_tokens"], work["decode_reqs"], work["kv_tokens"])


def install_sleep(model) -> None:
    """In a worker: each forward first sleeps its emulated device time."""
    from vllm.v1.worker.gpu_worker import Worker

    original_execute = Worker.execute_model
    original_dummy = Worker.execute_dummy_batch

    def execute_model(self, scheduler_output):
        time.sleep(batch_ms(model, scheduler_output) / 1000.0)
        return original_execute(self, scheduler_output)

    def execute_dummy_batch(self):
        time.sleep(model.fixed_ms / 1000.0)
        return original_dummy(self)

    Worker.execute_model = execute_model
    Worker.execute_dummy_batch = execute_dummy_batch
    logger.warning(
        "DEVICE-TIME EMULATION: each forward sleeps %s before it runs (test support)", model
    )


# How often a host process polls for its peer's message while vLLM would spin (seconds).
HOST_POLL_S = 0.001


def throttle_host_spin() -> None:
    """The engine core's and the worker's waits on each other poll every millisecond instead of
    spinning.

    vLLM's shared-memory message queue keeps a reader in a ``sched_yield()`` loop for 1 s after
    its last read (``SpinCondition.busy_loop_s``) before it parks on a notification: an engine
    core waiting for its worker's forward spins through the whole emulated device time. On a real
    deployment each rank's host has its own cores for that; here 4-8 ranks share 2 cores, and
    their spinning took 30-45% of a core per rank at DP=4, CPU the other ranks need. Parking
    instead (``busy_loop_s`` 0) is not an option: it leans on the notification on every message,
    and about one wait in 200 then lost its notification and slept the 5 s recheck interval
    (``SHM_READER_RECHECK_INTERVAL_MS``), stalling every rank. So the spin stays, one poll of the
    shared flag per ``HOST_POLL_S``: up to 1 ms per message on a step of 100 ms or more.
    """
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    original_wait = SpinCondition.wait

    def wait(self, timeout_ms=None):
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(HOST_POLL_S)  # vLLM: sched_yield()
            return None
        return original_wait(self, timeout_ms)

    SpinCondition.wait = wait


def install_booking(model) -> None:
    """In an engine core: book what its worker sleeps, for the step records (``step_timing``).

    The worker is another process (vLLM's multiproc executor; at TP=1 it can also be this one);
    the engine core books the same function of the same ``SchedulerOutput`` instead of asking
    it: each step's ``update_from_output`` follows its forward, each dummy batch adds
    ``fixed_ms``.
    """
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    original_update = Scheduler.update_from_output
    original_dummy = EngineCore.execute_dummy_batch

    def update_from_output(self, scheduler_output, model_runner_output):
        EMULATED["device_ms"] += batch_ms(model, scheduler_output)
        return original_update(self, scheduler_output, model_runner_output)

    def execute_dummy_batch(self):
        EMULATED["device_ms"] += model.fixed_ms
        return original_dummy(self)

    Scheduler.update_from_output = update_from_output
    EngineCore.execute_dummy_batch = execute_dummy_batch


def register() -> None:
    path = os.environ.get(DEVICE_MODEL_ENV)
    if not path or _installed:
        return
    import multiprocessing

    # Workers sleep (their forward is the device's); engine cores book. The front end and the
    # DP coordinator run no forward. At TP=1 vLLM may run the worker inside the engine core
    # (uni executor): then that process does both.
    name = multiprocessing.current_process().name
    if not name.startswith(("EngineCore", "VllmWorker")):
        return
    model = load_device_model(path)
    throttle_host_spin()
    install_sleep(model)
    if name.startswith("EngineCore"):
        install_booking(model)
    _installed.append(path)
