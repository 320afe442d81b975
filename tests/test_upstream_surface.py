"""Every upstream name this package relies on exists, with the shape it is used in.

``shim/`` (scheduler, engine core, stats), ``vllm_balance/activation.py`` and ``registry.py`` read
these names from the installed vLLM (``compat/``'s anchors are checked by test_compat_derive.py).
``nox -s reach`` runs this file on every release of the support matrix, so a release that drops
one fails here by name instead of in a user's first ``schedule()``: 0.31 dropped
``Scheduler.skipped_waiting``, which the shim's counters read.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import vllm.v1.engine.core as core_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import DPEngineCoreProc, EngineCore, EngineCoreProc

from balance_testbed import factories


def assigned_self_attributes(cls: type) -> set[str]:
    """Names ``cls``'s own methods assign as ``self.<name> = ...`` (instance state it creates)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)  # also inside tuple targets: self.a, self.b = ...
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


# shim/scheduler.py


def test_scheduler_state_the_mixin_reads():
    scheduler = factories.make_scheduler(max_num_seqs=4)
    factories.add_requests(scheduler, factories.make_requests(3))
    assert isinstance(scheduler.running, list)
    assert scheduler.max_num_running_reqs == 4
    # The waiting count for deferred_admissions: upstream's own, whatever its queues are.
    assert scheduler.get_request_counts() == (0, 3)
    # The cap: the admission limit where the release has a separate one (0.31+).
    assert getattr(scheduler, "max_num_active_reqs", scheduler.max_num_running_reqs) == 4
    # A held step keeps it (the prefill cadence's saturation flag), every release 0.24+.
    assert scheduler.prefill_capacity_bound is False


# shim/gather.py and shim/scheduler.py


def test_group_and_pause_state_the_gather_follows():
    """The buffer is sized and ranked by the DP group (``size()``, ``rank()``: vLLM swaps the group
    on an elastic-EP resize); a rank paused with ``mode="keep"`` gathers 0, as vLLM's DP sync
    counts it (where the release has pause states)."""
    from torch.distributed import ProcessGroup

    from vllm_balance.shim.scheduler import PAUSED_ALL

    assert callable(ProcessGroup.size) and callable(ProcessGroup.rank)
    if PAUSED_ALL is not None:
        scheduler = factories.make_scheduler()
        factories.add_requests(scheduler, factories.make_requests(2))
        factories.step(scheduler)
        scheduler.set_pause_state(PAUSED_ALL)
        assert scheduler.pause_state == PAUSED_ALL and len(scheduler.running) == 2
        assert scheduler.get_num_unfinished_requests() == 0


def test_scheduler_classes_and_signatures_the_mixin_extends():
    assert issubclass(AsyncScheduler, Scheduler)
    assert parameters(Scheduler.schedule) == ["self", "throttle_prefills"]
    assert parameters(Scheduler.__init__)[:2] == ["self", "vllm_config"]
    assert SchedulerOutput.__module__ == "vllm.v1.core.sched.output"


# shim/metrics.py (and registry.STATS_DECODED_WITH_BALANCE)


def test_stats_route_the_metrics_ride():
    """The engine's stats hook, the wire type the API server decodes, the stat-logger plugin
    interface (tests/test_metrics.py runs the route itself on the pins)."""
    import dataclasses

    from vllm.plugins import STAT_LOGGER_PLUGINS_GROUP
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase, StatLoggerManager
    from vllm.v1.metrics.stats import SchedulerStats

    scheduler = factories.make_scheduler(log_stats=True)
    assert scheduler.log_stats is True and "make_stats" in vars(Scheduler)
    assert type(scheduler.make_stats()) is SchedulerStats and dataclasses.is_dataclass(
        SchedulerStats
    )
    assert "SchedulerStats" in str(EngineCoreOutputs.__dict__["__annotations__"]["scheduler_stats"])
    assert STAT_LOGGER_PLUGINS_GROUP == "vllm.stat_logger_plugins"
    assert parameters(AggregateStatLoggerBase.__init__) == ["self", "vllm_config", "engine_indexes"]
    assert "engine_idx" in parameters(AggregateStatLoggerBase.record)
    assert "custom_stat_loggers" in parameters(StatLoggerManager.__init__)


# shim/engine_core.py


def test_dp_engine_core_hook_and_the_state_it_hands_over():
    assert parameters(DPEngineCoreProc._has_global_unfinished_reqs) == ["self", "local_unfinished"]
    # The gather reads self.dp_group (the gloo DP group) and self.scheduler.
    assert "dp_group" in assigned_self_attributes(DPEngineCoreProc)
    assert "scheduler" in assigned_self_attributes(EngineCore)
    assert issubclass(DPEngineCoreProc, EngineCore)


# vllm_balance/activation.py and registry.py


def test_engine_core_launcher_the_activation_wraps():
    launcher = EngineCoreProc.__dict__["run_engine_core"]
    assert isinstance(launcher, staticmethod)
    assert {"dp_rank", "local_dp_rank"} <= set(parameters(launcher.__func__))
    # Swapped per process by name: a module global that run_engine_core resolves at call time
    # (tests/test_activation.py checks the call-time resolution by behaviour).
    assert core_module.DPEngineCoreProc is DPEngineCoreProc


def test_config_fields_activation_and_options_read():
    import dataclasses

    from vllm.config import KVTransferConfig

    # PD-disaggregated configs are refused by their kv_role.
    assert "kv_role" in {f.name for f in dataclasses.fields(KVTransferConfig)}
    config = factories.make_vllm_config(data_parallel_size=2, additional_config={"k": 1})
    assert config.parallel_config.data_parallel_size == 2
    assert config.parallel_config.data_parallel_rank == 0
    assert config.model_config.is_moe is True
    assert config.kv_transfer_config is None
    assert config.additional_config == {"k": 1}
    assert config.scheduler_config.scheduler_cls is None or isinstance(
        config.scheduler_config.scheduler_cls, (str, type)
    )
    assert config.scheduler_config.get_scheduler_cls() in (Scheduler, AsyncScheduler)
