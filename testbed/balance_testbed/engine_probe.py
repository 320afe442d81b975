"""A probe for engine-core child processes started the way vLLM's launcher starts them.

vLLM's ``CoreEngineProcManager`` starts ``context.Process(target=EngineCoreProc.run_engine_core,
kwargs={vllm_config, local_client, handshake_address, executor_class, log_stats, dp_rank,
local_dp_rank})`` with the spawn or fork method. The probe stops the child at the first thing the
engine core does after it has been constructed by class (``_perform_handshakes``, before any
front-end traffic) and writes down what the child actually built.

Spawn children are reached by unpickling: a ``HandshakeProbe`` placed in the config's
``additional_config`` installs the probe when the child unpickles its kwargs. Fork children
inherit a probe installed in the parent. Only upstream's handshake is replaced; the wrapper, the
engine-core class swap and the scheduler selection under test run untouched.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path


def _report(engine_core, vllm_config, report_path: str) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.engine.core import EngineCoreProc

    from balance_testbed.vllm_ascend_standin import qualified, vllm_name_facts

    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    report = {
        "engine_core": type(engine_core).__name__,
        "engine_core_bases": [c.__name__ for c in type(engine_core).__mro__],
        "scheduler_cls": getattr(scheduler_cls, "__name__", scheduler_cls),
        "scheduler_bases": [c.__name__ for c in getattr(scheduler_cls, "__mro__", ())],
        "scheduler_is_async": isinstance(scheduler_cls, type)
        and issubclass(scheduler_cls, AsyncScheduler),
        "run_engine_core": EngineCoreProc.run_engine_core.__module__,
        "engine_core_mro": [qualified(c) for c in type(engine_core).__mro__],
        "scheduler_mro": [qualified(c) for c in getattr(scheduler_cls, "__mro__", ())],
        "names": vllm_name_facts(),
    }
    Path(report_path).write_text(json.dumps(report))


def install_probe(report_path: str, load_general_plugins: bool = False) -> HandshakeProbe:
    """``load_general_plugins``: first do what ``EngineCore.__init__`` does first (vLLM 0.24.0 and
    0.25.0 ``v1/engine/core.py`` L110, 0.30.0 L119, 0.33.0 L135), so that the report shows the
    names after a spawned child's first plugin load (a fork child inherits the front end's and
    loads none)."""
    from vllm.v1.engine.core import EngineCoreProc

    def probe(self, handshake_address, identity, local_client, vllm_config, *args, **kwargs):
        if load_general_plugins:
            from vllm.plugins import load_general_plugins as load

            load()
        _report(self, vllm_config, report_path)
        raise SystemExit(0)  # stop before talking to a front end that does not exist

    EngineCoreProc._perform_handshakes = probe  # type: ignore[method-assign]
    return HandshakeProbe(report_path, load_general_plugins)


class HandshakeProbe:
    """Rides inside ``additional_config``; unpickling it in a spawn child installs the probe."""

    def __init__(self, report_path: str, load_general_plugins: bool = False) -> None:
        self.report_path = report_path
        self.load_general_plugins = load_general_plugins

    def __reduce__(self):
        return (install_probe, (self.report_path, self.load_general_plugins))

    def __hash__(self) -> int:
        return hash(self.report_path)


def launch_engine_core(method: str, vllm_config, report_path: str, target=None) -> dict:
    """Start one engine-core child like vLLM does, wait for it, return the probe's report."""
    import multiprocessing

    from vllm.v1.engine.core import EngineCoreProc

    # Garbage of earlier tests (a gloo process group in a reference cycle) must not reach a forked
    # child: its collector would run the group's destructor, which joins threads that exist only
    # in this process, and the child dies with SIGSEGV before the probe.
    gc.collect()
    context = multiprocessing.get_context(method)
    process = context.Process(
        target=target or EngineCoreProc.run_engine_core,
        name="EngineCore_DP0",
        kwargs=dict(
            vllm_config=vllm_config,
            local_client=True,
            handshake_address="ipc:///nonexistent-probe",
            executor_class=None,
            log_stats=False,
            dp_rank=0,
            local_dp_rank=0,
        ),
    )
    process.start()
    process.join(timeout=180)
    if process.is_alive():
        process.kill()
        raise AssertionError(f"{method} engine-core child did not stop at the probe")
    path = Path(report_path)
    assert path.exists(), f"{method} child exited {process.exitcode} without a probe report"
    return json.loads(path.read_text())
