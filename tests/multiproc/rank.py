"""Entry point of one engine-core rank process started by the harness.

    python -m tests.multiproc.rank '<json>'    (or rank_main(spec) in a forkserver child)

The process builds a real ``VllmConfig`` (tiny local MoE config), then calls vLLM's own
``EngineCoreProc.run_engine_core`` exactly as vLLM's launcher does (``vllm_config``,
``local_client``, ``handshake_address``, ``executor_class``, ``log_stats``, ``dp_rank``,
``local_dp_rank``). From there everything is upstream's or ours: the ZMQ handshake with the
front end (played by the harness), ``DPEngineCoreProc._init_data_parallel`` creating the gloo DP
group through ``ParallelConfig.stateless_init_dp_group()``, the scheduler, the input/output
threads and ``DPEngineCoreProc.run_busy_loop``. Only the model forward is the stand-in executor.

Modes:
- ``balance``: the package's plugin ``register()`` installs the ``run_engine_core`` wrapper, so
  activation picks the balance scheduler and swaps in ``BalanceDPEngineCoreProc`` (shipped path).
- ``baseline``: same wrapper, balance not enabled (activation restores upstream classes).
- ``lesson_a`` / ``lesson_b``: the negative controls of ``variants.py`` installed by hand, and
  upstream's ``run_engine_core`` called directly (the wrapper would install the shipped hook).

Observation only (no behaviour change): ``torch.distributed.all_gather`` and the built scheduler
class's ``schedule`` are wrapped to append records (see ``records.py``), and SIGUSR1 dumps every
thread's stack to a file so a hang can be attributed.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import tempfile
from typing import Any

MODES = ("balance", "baseline", "lesson_a", "lesson_b")


def _instrument_all_gather() -> None:
    import torch.distributed as dist

    from tests.multiproc import records

    upstream_all_gather = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        work = upstream_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        records.append("gather", queue=[int(t.item()) for t in tensor_list])
        return work

    dist.all_gather = all_gather


def _instrument_scheduler_class(scheduler_cls: type) -> None:
    from tests.multiproc import records

    if scheduler_cls.__dict__.get("_harness_instrumented"):
        return
    upstream_schedule = scheduler_cls.schedule

    def schedule(self, throttle_prefills: bool = False):
        # Activation asks get_scheduler_cls() for vLLM's own class too, so the base class gets
        # instrumented as well, and the shim's schedule() reaches it through super(): record the
        # outermost call only, one record per engine step.
        if getattr(self, "_harness_in_schedule", False):
            return upstream_schedule(self, throttle_prefills)
        from balance_testbed.factories import gate_read

        gate = getattr(self, "balance_gate", None)
        queue_values = None if gate is None else gate_read(self)
        waiting, running = len(self.waiting), len(self.running)
        self._harness_in_schedule = True
        try:
            output = upstream_schedule(self, throttle_prefills)
        finally:
            self._harness_in_schedule = False
        records.append(
            "schedule",
            cls=type(self).__name__,
            queue=queue_values,
            frozen=None if gate is None else gate.frozen,
            waiting=waiting,
            running=running,
            cap=self.max_num_running_reqs,
            # vLLM's pause (pause_scheduler, sleep) admits nothing, whatever the gate says.
            paused=int(getattr(self, "pause_state", 0)) != 0,
            admitted=len(output.scheduled_new_reqs),
            # Preempted requests the WAITING loop resumed (vLLM's pause with clear_cache
            # preempts the running ones): admitted too, as far as the gate is concerned.
            resumed=len(getattr(output.scheduled_cached_reqs, "resumed_req_ids", ())),
            tokens=output.total_num_scheduled_tokens,
        )
        return output

    scheduler_cls.schedule = schedule
    scheduler_cls._harness_instrumented = True


def _instrument_scheduler_selection() -> None:
    """Instrument whichever scheduler class the engine core builds (known only at that time)."""
    from vllm.config import SchedulerConfig

    upstream_get = SchedulerConfig.get_scheduler_cls

    def get_scheduler_cls(self):
        cls = upstream_get(self)
        _instrument_scheduler_class(cls)
        return cls

    SchedulerConfig.get_scheduler_cls = get_scheduler_cls


def build_config(spec: dict) -> Any:
    from balance_testbed.factories import make_vllm_config

    additional = {} if spec["mode"] == "baseline" else {"enable_balance_scheduling": True}
    additional.update(spec.get("additional_config", {}))
    return make_vllm_config(
        moe=True,
        max_num_seqs=spec["cap"],
        max_model_len=2048,
        data_parallel_size=spec["dp_size"],
        additional_config=additional,
    )


def run(spec: dict) -> None:
    import vllm.v1.engine.core as engine_core_module
    from vllm.v1.engine.core import EngineCoreProc

    from tests.multiproc.standin import StandInExecutor

    mode = spec["mode"]
    vllm_config = build_config(spec)
    _instrument_all_gather()
    _instrument_scheduler_selection()
    if mode in ("balance", "baseline"):
        import vllm_balance.plugin

        vllm_balance.plugin.register()
        entry = EngineCoreProc.run_engine_core
    else:
        import vllm_balance
        from balance_testbed import variants
        from vllm_balance.registry import RUN_ENGINE_CORE_WRAPPER

        entry = RUN_ENGINE_CORE_WRAPPER.upstream()
        if mode == "lesson_a":
            engine_core_module.DPEngineCoreProc = variants.InjectDpGroupEngine
            scheduler_cls = variants.gather_in_schedule_scheduler(vllm_balance.BalanceScheduler)
        else:
            engine_core_module.DPEngineCoreProc = variants.GatherInEngineStepEngine
            scheduler_cls = vllm_balance.BalanceScheduler
        vllm_config.scheduler_config.scheduler_cls = scheduler_cls
    entry(
        vllm_config=vllm_config,
        local_client=True,
        handshake_address=spec["handshake_address"],
        executor_class=StandInExecutor,
        log_stats=False,
        dp_rank=spec["dp_rank"],
        local_dp_rank=spec["dp_rank"],
    )


def apply_inherited_mutant() -> None:
    """The mutant ``tests/mutation/run.py`` applied in the pytest process, applied here too: a
    process forked from the harness's forkserver inherits its environment, not its patches."""
    mutant = os.environ.get("VLLM_BALANCE_MUTANT", "none")
    if mutant != "none":
        import mutants  # tests/mutation/, on PYTHONPATH in a mutation run

        mutants.MUTANTS[mutant].apply()


def rank_main(spec: dict) -> None:
    """Process target (forkserver child): private log, env and temp dir, then ``run``."""
    if spec["mode"] not in MODES:
        raise SystemExit(f"unknown mode {spec['mode']!r}")
    apply_inherited_mutant()
    log_fd = os.open(spec["log_file"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.environ.update(spec.get("env", {}))
    tempfile.tempdir = spec["tmpdir"]
    stack_file = open(spec["stack_file"], "a")  # noqa: SIM115 (kept open for faulthandler)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    run(spec)


if __name__ == "__main__":
    rank_main(json.loads(sys.argv[1]))
