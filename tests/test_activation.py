"""Activation: plugin, run_engine_core wrapper, engine-core swap, scheduler selection.

The child-process tests start engine cores exactly as vLLM's launcher does (target
``EngineCoreProc.run_engine_core``, spawn and fork) and read what the child really built.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import vllm.v1.engine.core as core_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc

import vllm_balance
from balance_testbed import factories
from balance_testbed.engine_probe import HandshakeProbe, install_probe, launch_engine_core
from vllm_balance import activation, plugin, registry
from vllm_balance.ascend import takeover
from vllm_balance.config import DEPRECATED_ENV_VAR
from vllm_balance.log import LOGGER_NAME
from vllm_balance.shim.engine_core import BalanceDPEngineCoreProc
from vllm_balance.shim.scheduler import BalanceSchedulerMixin

ENABLED = {"enable_balance_scheduling": True}
UPSTREAM_RUN_ENGINE_CORE = EngineCoreProc.__dict__["run_engine_core"]


@pytest.fixture(autouse=True)
def restore_patches():
    yield
    registry.uninstall_all()
    assert core_module.DPEngineCoreProc is DPEngineCoreProc
    assert EngineCoreProc.__dict__["run_engine_core"] is UPSTREAM_RUN_ENGINE_CORE


def dp_config(moe=True, dp=2, additional_config=ENABLED, **kwargs):
    return factories.make_vllm_config(
        moe=moe, data_parallel_size=dp, additional_config=dict(additional_config), **kwargs
    )


# Registry and plugin


def test_every_patch_is_reversible():
    # From vLLM's own names: an earlier test in this process may have loaded the plugins, which
    # installs the run_engine_core wrapper (install() on an installed patch is a no-op).
    registry.uninstall_all()
    for patch in registry.ALL_PATCHES:
        before = patch.current()
        patch.install()
        assert patch.is_current() and patch.current() is not before
        patch.uninstall()
        assert patch.current() is before


def test_every_patch_names_its_replacement_and_resolves_it_to_one_object():
    # Readable statically: "module:name", or a function the entry names the same way, never a
    # placeholder another module fills in at import; resolved once (is_current() compares it).
    from vllm_balance.ascend.patches import TAKE_OVER_PATCHES

    for patch in registry.ALL_PATCHES + TAKE_OVER_PATCHES:
        named = patch.replacement
        assert isinstance(named, str) or named.__module__ == registry.__name__, patch.name
        assert patch.resolved() is patch.resolved(), patch.name


def test_plugin_with_balance_off_leaves_every_upstream_class_identical():
    import vllm.v1.core.sched.async_scheduler as async_module
    import vllm.v1.core.sched.scheduler as scheduler_module

    plugin.register()
    assert activation.activate_for(dp_config(additional_config={})) is False
    assert scheduler_module.Scheduler is Scheduler
    assert async_module.AsyncScheduler is AsyncScheduler
    assert core_module.DPEngineCoreProc is DPEngineCoreProc
    assert core_module.EngineCoreProc is EngineCoreProc


# A fresh interpreter: every vLLM object (each loaded vllm.* module's attributes and the members
# of the classes it defines, annotations by content) before and after vLLM's own plugin loader
# ran this package's plugin, its stat-logger plugin was loaded and the engine-core wrapper decided
# on a balance-off DP=2 MoE config (what the wrapper does before it calls upstream's function).
IDENTITY_PROBE = textwrap.dedent(
    """
    import importlib, json, sys
    from balance_testbed.factories import make_vllm_config
    for name in ("vllm.v1.core.sched.scheduler", "vllm.v1.core.sched.async_scheduler",
                 "vllm.v1.engine.core", "vllm.v1.engine", "vllm.v1.engine.core_client",
                 "vllm.v1.metrics.stats", "vllm.v1.metrics.loggers", "vllm.v1.serial_utils"):
        importlib.import_module(name)
    config = make_vllm_config(moe=True, data_parallel_size=2, additional_config={})

    def snapshot():
        seen = {}
        for name, module in list(sys.modules.items()):
            if module is None or not (name == "vllm" or name.startswith("vllm.")):
                continue
            for attr, value in list(vars(module).items()):
                seen[f"{name}.{attr}"] = id(value)
                if isinstance(value, type) and value.__module__ == name:
                    for member, inner in list(vars(value).items()):
                        seen[f"{name}.{attr}.{member}"] = id(inner)
                        if member == "__annotations__":
                            seen[f"{name}.{attr}.{member}[]"] = repr(sorted(inner.items()))
        return seen

    before = snapshot()
    import vllm.plugins
    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories
    vllm.plugins.load_general_plugins()
    factories = load_stat_logger_plugin_factories()
    from vllm_balance import activation
    active = activation.activate_for(config)
    after = snapshot()
    # vllm.plugins: the loader's own bookkeeping (plugins_loaded), vLLM's state, not ours.
    def changed(then, now):
        return sorted(k for k in then if k in now and then[k] != now[k]
                      and not k.startswith("vllm.plugins."))
    from vllm.v1.engine.core import EngineCoreProc
    wrapper = EngineCoreProc.__dict__["run_engine_core"].__func__
    # Negative control: the decode patch the API server gets with VLLM_BALANCE_METRICS=1.
    from vllm_balance.registry import STATS_DECODED_WITH_BALANCE, ray_backend_present
    STATS_DECODED_WITH_BALANCE.install()
    print(json.dumps({"active": active, "changed": changed(before, after),
                      "ray_backend_present": ray_backend_present(),
                      "control": changed(after, snapshot()),
                      "wrapper": f"{wrapper.__module__}.{wrapper.__qualname__}",
                      "stat_loggers": [f.__name__ for f in factories]}))
    """
)
RUN_ENGINE_CORE_NAME = "vllm.v1.engine.core.EngineCoreProc.run_engine_core"
RAY_MANAGER_INIT_NAME = "vllm.v1.engine.utils.CoreEngineActorManager.__init__"


@pytest.mark.path_independent  # balance off: no path is chosen
def test_installed_with_balance_off_every_vllm_object_is_upstreams_but_the_pass_through_wrapper():
    """The one object that differs: ``EngineCoreProc.run_engine_core``, the wrapper a general
    plugin needs (it is the first code that sees an engine process's config), and where Ray is
    installed the Ray launcher's ``CoreEngineActorManager.__init__`` (the same, for Ray's actors);
    with balance off they pass straight through. No annotation is rewritten, no class swapped.
    Control: the probe does see the API server's decode patch (an annotation rewrite) once it is
    installed."""
    import json
    import os

    env = dict(os.environ, VLLM_PLUGINS="balance_scheduling")
    env.pop("VLLM_BALANCE_METRICS", None)
    result = subprocess.run(
        [sys.executable, "-c", IDENTITY_PROBE], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.splitlines()[-1])
    assert facts["active"] is False
    # Where Ray is installed, the Ray launcher's constructor is wrapped too (plugin.py says why).
    expected = [RUN_ENGINE_CORE_NAME] + (
        [RAY_MANAGER_INIT_NAME] if facts["ray_backend_present"] else []
    )
    assert sorted(facts["changed"]) == sorted(expected), facts["changed"]
    assert facts["wrapper"] == "vllm_balance.activation.balance_run_engine_core"
    assert facts["stat_loggers"] == ["BalanceStatLogger"]
    assert "vllm.v1.engine.EngineCoreOutputs.__annotations__[]" in facts["control"], facts


def test_plugin_is_declared_as_a_vllm_general_plugin():
    from importlib.metadata import entry_points

    # By name, as vLLM's loader keys them: the e2e test plugins' values start with vllm_balance too.
    ours = {e.name: e for e in entry_points(group="vllm.general_plugins")}
    assert ours["balance_scheduling"].load() is plugin.register


# Activation decisions (in process)


def test_balance_on_swaps_engine_core_and_selects_the_balance_scheduler():
    config = dp_config()
    assert activation.activate_for(config) is True
    assert core_module.DPEngineCoreProc is BalanceDPEngineCoreProc
    assert config.scheduler_config.scheduler_cls is vllm_balance.BalanceScheduler


def test_engine_core_warns_about_its_config_once(monkeypatch, caplog, fresh_once_logs):
    # The activation reads the config and the scheduler vLLM then builds reads it again; the
    # deprecated variable's warning prints once per engine process all the same.
    monkeypatch.setenv(DEPRECATED_ENV_VAR, "1")
    config = dp_config(additional_config={})
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert activation.activate_for(config) is True
        scheduler = factories.make_scheduler(config.scheduler_config.scheduler_cls, config)
    assert scheduler.balance_gate is not None
    assert caplog.text.count(f"{DEPRECATED_ENV_VAR} is deprecated") == 1, caplog.text


def test_balance_off_restores_upstream_engine_core_and_leaves_config_alone():
    activation.activate_for(dp_config())
    config = dp_config(additional_config={})
    assert activation.activate_for(config) is False
    assert core_module.DPEngineCoreProc is DPEngineCoreProc
    assert config.scheduler_config.scheduler_cls is None


def test_async_scheduling_gets_the_async_balance_scheduler():
    config = dp_config(async_scheduling=True)
    activation.activate_for(config)
    chosen = config.scheduler_config.scheduler_cls
    assert issubclass(chosen, AsyncScheduler) and issubclass(chosen, BalanceSchedulerMixin)


def test_balance_aware_user_scheduler_cls_is_kept():
    class MyBalanceScheduler(BalanceSchedulerMixin, Scheduler):
        pass

    config = dp_config(scheduler_cls=MyBalanceScheduler)
    activation.activate_for(config)
    assert config.scheduler_config.scheduler_cls is MyBalanceScheduler


# Import order is the mechanism here; each path's class mapping is checked in-process
# (test_async_scheduling_gets_the_async_balance_scheduler).
@pytest.mark.path_independent
@pytest.mark.parametrize("async_first", [True, False], ids=["async-imported-first", "ours-first"])
def test_async_scheduler_gets_balance_whatever_the_import_order(async_first):
    imports = ["import vllm.v1.core.sched.async_scheduler", "import vllm_balance.selection"]
    code = "\n".join(imports if async_first else imports[::-1]) + textwrap.dedent(
        """
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from balance_testbed import factories
        from vllm_balance.selection import balance_counterpart
        cls = balance_counterpart(AsyncScheduler)
        assert issubclass(cls, AsyncScheduler), cls.__mro__
        s = factories.make_scheduler(cls, data_parallel_size=2, max_num_seqs=2,
                                     additional_config={"enable_balance_scheduling": True})
        factories.add_requests(s, factories.make_requests(3))
        s.balance_gate.set_gathered([2, 0])
        assert s.schedule().scheduled_new_reqs == [], "gate did not apply"
        print("OK", cls.__name__)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# Engine-core children started the way vLLM's launcher starts them


def test_upstream_run_engine_core_resolves_dp_engine_core_by_name_at_call_time(
    tmp_path, monkeypatch
):
    """Load-bearing assumption of the activation: checked by behaviour, not by source text."""

    class ProbeDPEngineCoreProc(DPEngineCoreProc):
        pass

    report = str(tmp_path / "report.json")
    monkeypatch.setattr(EngineCoreProc, "_perform_handshakes", EngineCoreProc._perform_handshakes)
    install_probe(report)  # the fork child inherits it
    core_module.DPEngineCoreProc = ProbeDPEngineCoreProc
    try:
        result = launch_engine_core("fork", dp_config(additional_config={}), report)
    finally:
        core_module.DPEngineCoreProc = DPEngineCoreProc
    assert result["engine_core"] == "ProbeDPEngineCoreProc"


def test_fork_child_runs_balance_engine_core_and_scheduler(forked_probe):
    plugin.register()
    result = launch_engine_core("fork", dp_config(), forked_probe)
    assert result["engine_core"] == "BalanceDPEngineCoreProc"
    assert result["scheduler_cls"] == vllm_balance.BalanceScheduler.__name__
    assert result["run_engine_core"] == "vllm_balance.activation"


@pytest.mark.parametrize(
    "config_kwargs, engine_core",
    [(dict(additional_config={}), "DPEngineCoreProc"), (dict(moe=False), "EngineCoreProc")],
    ids=["balance-off", "dense-model"],
)
def test_fork_child_without_effective_balance_is_untouched(
    forked_probe, config_kwargs, engine_core
):
    plugin.register()
    result = launch_engine_core("fork", dp_config(**config_kwargs), forked_probe)
    assert result["engine_core"] == engine_core
    assert result["scheduler_cls"] is None


def test_spawn_child_runs_balance_engine_core_and_async_scheduler(tmp_path):
    # One spawn child (a fresh interpreter costs seconds); the fork tests cover the sync class.
    plugin.register()  # the front end loads plugins before it launches engine cores
    report = str(tmp_path / "report.json")
    config = dp_config(
        additional_config={**ENABLED, "_probe": HandshakeProbe(report)}, async_scheduling=True
    )
    result = launch_engine_core("spawn", config, report)
    assert result["engine_core"] == "BalanceDPEngineCoreProc"
    assert "BalanceSchedulerMixin" in result["scheduler_bases"]
    # Only the wrapper swaps the engine core: the child ran it (spawn pickled the wrapper as
    # the target; the child's class attribute is upstream's until plugins load).
    assert result["scheduler_is_async"] is True


# Validation (clear messages)


def with_kv_role(monkeypatch, config, role):
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(kv_connector="NixlConnector", kv_role=role)
    monkeypatch.setattr(config, "kv_transfer_config", transfer)
    return config


def test_pd_disaggregated_is_refused(monkeypatch):
    config = with_kv_role(monkeypatch, dp_config(), "kv_producer")
    with pytest.raises(ValueError) as excinfo:
        activation.activate_for(config)
    assert str(excinfo.value) == (
        "balance scheduling supports PD-mixed mode only; kv_transfer_config.kv_role="
        "'kv_producer' (PD-disaggregated) cannot enable enable_balance_scheduling"
    )
    assert core_module.DPEngineCoreProc is DPEngineCoreProc


def test_pd_disaggregated_decode_side_kv_consumer_is_refused(monkeypatch):
    config = with_kv_role(monkeypatch, dp_config(), "kv_consumer")
    with pytest.raises(ValueError, match=r"mode only; kv_transfer_config\.kv_role='kv_consumer' "):
        activation.activate_for(config)
    assert core_module.DPEngineCoreProc is DPEngineCoreProc


def test_pd_mixed_kv_both_activates_balance(monkeypatch):
    # kv_both: one instance both prefills and decodes (e.g. KV offloading), i.e. PD-mixed.
    config = with_kv_role(monkeypatch, dp_config(), "kv_both")
    assert activation.activate_for(config) is True
    assert core_module.DPEngineCoreProc is BalanceDPEngineCoreProc


def test_foreign_scheduler_cls_is_refused_with_how_to_combine():
    class OtherScheduler(Scheduler):
        pass

    with pytest.raises(ValueError, match="balance scheduling needs its own scheduler") as excinfo:
        activation.activate_for(dp_config(scheduler_cls=OtherScheduler))
    assert "BalanceSchedulerMixin" in str(excinfo.value)


@pytest.mark.parametrize(
    "config_kwargs, message",
    [
        (dict(dp=1), "data_parallel_size=1: it has no effect without data parallelism"),
        (dict(moe=False), "the model is not MoE: vLLM runs dense DP ranks as independent engines"),
    ],
    ids=["dp1", "dense"],
)
def test_balance_that_cannot_act_warns_and_installs_nothing(caplog, config_kwargs, message):
    config = dp_config(**config_kwargs)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert activation.activate_for(config) is False
    assert message in caplog.text
    assert core_module.DPEngineCoreProc is DPEngineCoreProc
    assert config.scheduler_config.scheduler_cls is None


@pytest.mark.parametrize("config_kwargs", [dict(dp=1), dict(moe=False)], ids=["dp1", "dense"])
def test_a_bad_key_is_an_error_even_where_balance_then_installs_nothing(config_kwargs):
    # The keys are read once, before the DP and MoE checks: a typo is found on the first start.
    config = dp_config(**config_kwargs, additional_config={**ENABLED, "balance_collective": "ring"})
    with pytest.raises(ValueError, match="balance_collective must be one of"):
        activation.activate_for(config)
    assert core_module.DPEngineCoreProc is DPEngineCoreProc


def test_a_bad_key_is_not_read_with_balance_off():
    config = dp_config(additional_config={"balance_collective": "ring"})
    assert activation.activate_for(config) is False


ASCEND_PATCH_MODULE = "vllm_ascend.patch.platform.patch_balance_schedule"


@pytest.mark.parametrize(
    "patched", ["DPEngineCoreProc", "run_engine_core", "run_engine_core-under-our-wrapper"]
)
def test_next_to_vllm_ascends_patches_this_package_steps_aside(monkeypatch, caplog, patched):
    """Without the take-over, vllm-ascend's own balance runs as it ships it: nothing of theirs is
    refused, nothing of ours installed, and one warning says so (two gates would gather twice)."""
    # vllm-ascend's built-in balance (and its DyntraLB) replace these two as well as Scheduler.
    if patched == "DPEngineCoreProc":
        name = "vllm.v1.engine.core.DPEngineCoreProc"
        foreign = type("BalanceDPEngineCoreProc", (DPEngineCoreProc,), {})
        foreign.__module__ = ASCEND_PATCH_MODULE
        monkeypatch.setattr(core_module, "DPEngineCoreProc", foreign)
    else:
        name = "EngineCoreProc.run_engine_core"

        def foreign(*args, **kwargs):
            raise AssertionError("not called: activation only decides")

        foreign.__module__ = ASCEND_PATCH_MODULE
        monkeypatch.setattr(EngineCoreProc, "run_engine_core", staticmethod(foreign))
        if patched == "run_engine_core-under-our-wrapper":
            plugin.register()  # both plugins loaded: our wrapper now wraps vllm-ascend's
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
            assert activation.activate_for(dp_config()) is False
        swapped = registry.DP_ENGINE_CORE_SWAP.is_current()
    finally:
        # Ours first (it gives back vllm-ascend's wrapper and forgets it), then the stand-in's:
        # in the other order the registry would keep the wrapper as what it stands in front of.
        registry.uninstall_all()
        monkeypatch.undo()  # before restore_patches checks that upstream's objects are back
    assert "balance scheduling is already patched in by vllm-ascend (" in caplog.text
    assert f"{name} -> {ASCEND_PATCH_MODULE}.{foreign.__qualname__}" in caplog.text
    assert "own balance scheduling runs and this package installs nothing" in caplog.text
    assert not swapped


@pytest.mark.parametrize("config_kwargs", [dict(dp=1), dict(moe=False)], ids=["dp1", "dense"])
def test_refusals_only_where_balance_could_act_a_warning_elsewhere(
    monkeypatch, caplog, config_kwargs
):
    """PD-disaggregated and vllm-ascend's own balance patch are refused at DP > 1 with an MoE
    model only: elsewhere balance installs nothing, so nothing conflicts (vllm-ascend's DP=1
    configs that set the key start with the package installed)."""
    import types

    import vllm.v1.core.sched.scheduler as scheduler_module

    module = types.ModuleType("vllm_ascend.patch.platform.patch_balance_schedule")
    ascend_scheduler = type("BalanceScheduler", (Scheduler,), {"__module__": module.__name__})
    monkeypatch.setattr(scheduler_module, "Scheduler", ascend_scheduler)
    config = with_kv_role(monkeypatch, dp_config(**config_kwargs), "kv_producer")
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert activation.activate_for(config) is False
    assert "nothing is installed" in caplog.text
    assert core_module.DPEngineCoreProc is DPEngineCoreProc


class _AscendCopy(Scheduler):
    """vllm-ascend's released BalanceScheduler, in shape: its own scheduling loop."""

    __module__ = ASCEND_PATCH_MODULE

    def schedule(self, throttle_prefills=False):
        while self.waiting:
            break
        return super().schedule(throttle_prefills)


class _AscendPauseState(Scheduler):
    """vllm-ascend's BalanceScheduler after the pause-state PR, in shape: no loop of its own."""

    __module__ = ASCEND_PATCH_MODULE

    def schedule(self, throttle_prefills=False):
        return super().schedule(throttle_prefills)


def _as_vllm_ascends(monkeypatch, shape):
    """What vllm-ascend's built-in patch does: swap the module-level Scheduler for its own class."""
    import vllm.v1.core.sched.scheduler as scheduler_module

    cls = type("BalanceScheduler", (shape,), {"__module__": ASCEND_PATCH_MODULE})
    monkeypatch.setattr(scheduler_module, "Scheduler", cls)
    return cls


@pytest.mark.parametrize("shape", [_AscendCopy, _AscendPauseState], ids=["copy", "pause"])
def test_vllm_ascend_balance_patch_active_is_left_to_run(monkeypatch, caplog, shape):
    import vllm.v1.core.sched.scheduler as scheduler_module

    ascend_scheduler = _as_vllm_ascends(monkeypatch, shape)
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        assert activation.activate_for(dp_config()) is False
    assert (
        "balance scheduling is already patched in by vllm-ascend (vllm.v1.core.sched.scheduler."
        "Scheduler -> vllm_ascend.patch.platform.patch_balance_schedule.BalanceScheduler): "
        "vllm-ascend's own balance scheduling runs"
    ) in caplog.text
    assert core_module.DPEngineCoreProc is DPEngineCoreProc
    assert scheduler_module.Scheduler is ascend_scheduler


def test_take_over_is_refused_where_vllm_ascend_copies_no_schedule(monkeypatch):
    """The take-over replaces a copy of schedule(); a vllm-ascend holding on PAUSED_NEW has none."""
    _as_vllm_ascends(monkeypatch, _AscendCopy)
    assert takeover.vllm_ascend_copies_schedule()
    _as_vllm_ascends(monkeypatch, _AscendPauseState)
    assert not takeover.vllm_ascend_copies_schedule()
    monkeypatch.setenv("VLLM_BALANCE_TAKE_OVER_VLLM_ASCEND", "1")
    with pytest.raises(ValueError, match=r"copies no schedule\(\).*nothing to take over"):
        activation.activate_for(dp_config())
    assert core_module.DPEngineCoreProc is DPEngineCoreProc
