"""Take-over mode: this package next to vllm-ascend's own balance patch (vllm_balance/takeover.py).

vllm-ascend cannot be imported on CPU; ``tests/ascend_standin/`` performs its balance patch's name
swaps (and DyntraLB's wrapper on top) in the same order, with the real lines named next to each.
It is a distribution with vllm-ascend's general-plugin entry points, so vLLM's own
``load_general_plugins()`` loads it, before or after this package depending on ``sys.path``
(both orders below). Engine-core processes are started the way vLLM's launcher starts them
(``engine_probe.launch_engine_core``, fork and spawn; the full launcher in
``test_full_launcher_*``) and report what they built and where vLLM's names point.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import textwrap

import factories
import pytest
import vllm.plugins
import vllm.v1.core.sched.scheduler as scheduler_module
import vllm.v1.engine.core as core_module
from engine_probe import HandshakeProbe, launch_engine_core
from vllm.v1.engine.core import EngineCoreProc
from vllm_ascend_standin import (
    ORDERS,
    OUR_PLUGIN,
    general_plugin_names,
    vllm_ascend_in,
    vllm_ascend_in_this_process,
    vllm_name_facts,
)

from vllm_balance import activation, plugin, registry
from vllm_balance.config import TAKE_OVER_KEY, balance_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENABLED = {"enable_balance_scheduling": True}
TAKE_OVER = {**ENABLED, TAKE_OVER_KEY: True}
VLLM_RUN_ENGINE_CORE = "vllm.v1.engine.core.EngineCoreProc.run_engine_core"
OUR_RUN_ENGINE_CORE = "vllm_balance.activation.balance_run_engine_core"
ASCEND_SCHEDULER = "vllm_ascend.patch.platform.patch_balance_schedule.BalanceScheduler"


def dp_config(additional_config, **kwargs):
    return factories.make_vllm_config(
        moe=True, data_parallel_size=2, additional_config=dict(additional_config), **kwargs
    )


@pytest.fixture(params=ORDERS)
def ascend(request):
    """vllm-ascend's plugins and ours loaded by vLLM's loader in this process, in both orders."""
    with vllm_ascend_in_this_process(request.param):
        vllm.plugins.load_general_plugins()
        yield request.param


def assert_vllm_names_restored_under_ours(names):
    assert names["Scheduler"] == "vllm.v1.core.sched.scheduler.Scheduler", names
    assert names["run_engine_core_reach"] == [OUR_RUN_ENGINE_CORE, VLLM_RUN_ENGINE_CORE], names
    assert not vllm_ascend_in(names["AsyncScheduler_mro"]), names
    assert not vllm_ascend_in(names["DPEngineCoreProc_mro"]), names


def assert_balance_classes_built(report):
    assert report["engine_core"] == "BalanceDPEngineCoreProc", report
    assert report["scheduler_mro"][0].startswith("vllm_balance."), report
    assert not vllm_ascend_in(report["engine_core_mro"] + report["scheduler_mro"]), report


# The front end, in this process


def test_vllm_loads_the_plugins_in_the_order_asked_for(ascend):
    names = general_plugin_names()
    ours, theirs = names.index(OUR_PLUGIN), names.index("ascend_kv_connector")
    assert (ours > theirs) if ascend == "ascend-first" else (ours < theirs), names


def test_our_wrapper_is_outermost_whatever_the_plugin_order(ascend):
    """The launcher's target is what is on top: ours must be there for the take-over to run."""
    reach = vllm_name_facts()["run_engine_core_reach"]
    assert reach[0] == OUR_RUN_ENGINE_CORE, reach
    assert vllm_ascend_in(reach), reach  # vllm-ascend's wrappers are still below ours
    assert vllm_name_facts()["Scheduler"] == ASCEND_SCHEDULER


def test_without_the_opt_in_the_refusal_names_it(ascend):
    with pytest.raises(ValueError) as excinfo:
        activation.activate_for(dp_config(ENABLED))
    message = str(excinfo.value)
    assert message.startswith(
        "balance scheduling is already patched in by vllm-ascend (vllm.v1.core.sched.scheduler."
        f"Scheduler -> {ASCEND_SCHEDULER}; EngineCoreProc.run_engine_core -> vllm_ascend."
    )
    assert f"Set additional_config.{TAKE_OVER_KEY}=true" in message
    assert vllm_name_facts()["Scheduler"] == ASCEND_SCHEDULER  # nothing touched


def test_take_over_restores_vllm_names_installs_ours_and_logs_one_line(ascend, caplog):
    config = dp_config(TAKE_OVER)
    with caplog.at_level(logging.INFO, logger="vllm_balance"):
        assert activation.activate_for(config) is True
    assert_vllm_names_restored_under_ours(vllm_name_facts())
    assert core_module.DPEngineCoreProc.__module__ == "vllm_balance.shim.engine_core"
    assert config.scheduler_config.scheduler_cls.__module__.startswith("vllm_balance.")
    [line] = [r.getMessage() for r in caplog.records if "takes over" in r.getMessage()]
    assert line.startswith(
        "balance scheduling takes over from vllm-ascend's own balance patch "
        f"(additional_config.{TAKE_OVER_KEY}=true): vLLM's Scheduler, AsyncScheduler, "
        f"DPEngineCoreProc and run_engine_core restored (were: vllm.v1.core.sched.scheduler."
        f"Scheduler -> {ASCEND_SCHEDULER}; "
    )


def vllm_names():
    return (
        scheduler_module.Scheduler,
        core_module.DPEngineCoreProc,
        EngineCoreProc.__dict__["run_engine_core"],
    )


def test_uninstall_all_after_a_take_over_leaves_exactly_vllm_ascends_names(ascend):
    registry.uninstall_all()  # our plugin's wrapper off: what vllm-ascend alone has
    vllm_ascend_alone = vllm_names()
    plugin.register()
    activation.activate_for(dp_config(TAKE_OVER))
    registry.uninstall_all()
    assert vllm_names() == vllm_ascend_alone


def test_every_take_over_patch_is_documented_and_reversible(ascend):
    for patch in registry.TAKE_OVER_PATCHES:
        assert all([patch.why, patch.how, patch.related_pr, patch.future_plan]), patch.name
    replaced = [patch.current() for patch in registry.TAKE_OVER_PATCHES]
    for patch in registry.TAKE_OVER_PATCHES:
        patch.install()
        assert patch.is_installed()
    for patch in reversed(registry.TAKE_OVER_PATCHES):
        patch.uninstall()
    assert [patch.current() for patch in registry.TAKE_OVER_PATCHES] == replaced


def test_take_over_refuses_to_drop_vllm_ascends_short_request_first(ascend):
    srf = {"scheduler_config": {"short_request_first_config": {"enabled": True}}}
    with pytest.raises(ValueError, match="cannot keep vllm-ascend's short_request_first_config"):
        activation.activate_for(dp_config({**TAKE_OVER, **srf}))
    assert vllm_name_facts()["Scheduler"] == ASCEND_SCHEDULER


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_opt_in_must_be_a_boolean(value):
    config = dp_config({**ENABLED, TAKE_OVER_KEY: value})
    with pytest.raises(ValueError, match=f"additional_config.{TAKE_OVER_KEY} must be a boolean"):
        balance_options(config)


def test_opt_in_without_vllm_ascend_warns_that_there_is_nothing_to_take_over(caplog):
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_balance"):
            assert activation.activate_for(dp_config(TAKE_OVER)) is True
    finally:
        registry.uninstall_all()
    assert f"{TAKE_OVER_KEY} is set but vllm-ascend's balance patch is not active" in caplog.text


# Engine-core processes started like vLLM's launcher starts them


@pytest.mark.parametrize("additional_config", [TAKE_OVER, {}], ids=["take-over", "balance-off"])
def test_fork_child_takes_over_or_leaves_vllm_ascend_alone(ascend, forked_probe, additional_config):
    result = launch_engine_core("fork", dp_config(additional_config), forked_probe)
    if additional_config:
        assert_balance_classes_built(result)
        assert_vllm_names_restored_under_ours(result["names"])
    else:  # vllm-ascend's patch decides alone: its wrapper restored vLLM's DPEngineCoreProc
        assert result["engine_core"] == "DPEngineCoreProc"
        assert result["names"]["Scheduler"] == ASCEND_SCHEDULER


def test_fork_child_without_the_opt_in_refuses_naming_it(ascend, forked_probe, capfd):
    with pytest.raises(AssertionError, match="without a probe report"):
        launch_engine_core("fork", dp_config(ENABLED), forked_probe)
    assert f"Set additional_config.{TAKE_OVER_KEY}=true" in capfd.readouterr().err


def import_async_scheduler_again(monkeypatch):
    """``AsyncScheduler``'s module first imported after vllm-ascend's swap, as in vllm-ascend's
    front end: ``platform._check_ascend_config`` imports its recompute scheduler (platform.py
    L815), which imports ``AsyncScheduler`` (recompute_scheduler.py L31)."""
    import vllm.v1.core.sched as sched_package

    name = "vllm.v1.core.sched.async_scheduler"
    monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sched_package, "async_scheduler", None)
    return importlib.import_module(name)


def test_fork_child_with_async_scheduler_defined_on_vllm_ascends_class_runs_ours(
    ascend, forked_probe, monkeypatch
):
    tainted = import_async_scheduler_again(monkeypatch).AsyncScheduler
    assert ASCEND_SCHEDULER in [f"{c.__module__}.{c.__qualname__}" for c in tainted.__mro__]
    result = launch_engine_core("fork", dp_config(TAKE_OVER, async_scheduling=True), forked_probe)
    # By name: this test process may hold balance classes built on the AsyncScheduler it had
    # before the re-import (an engine process builds them only after the take-over).
    assert "vllm.v1.core.sched.async_scheduler.AsyncScheduler" in result["scheduler_mro"]
    assert_balance_classes_built(result)
    assert_vllm_names_restored_under_ours(result["names"])


@pytest.mark.parametrize("ascend", ["ours-first"], indirect=True)
def test_spawn_child_takes_over_and_vllm_names_stay_restored_after_its_plugins_load(
    ascend, tmp_path
):
    """A fresh interpreter loads vllm-ascend's plugins only inside ``EngineCore.__init__``, after
    ``run_engine_core`` chose the engine core: its patches are applied first by our wrapper, so
    that the take-over sees them and that loading them later changes nothing."""
    report = str(tmp_path / "report.json")
    probe = HandshakeProbe(report, load_general_plugins=True)
    config = dp_config({**TAKE_OVER, "_probe": probe})
    result = launch_engine_core("spawn", config, report)
    assert_balance_classes_built(result)
    assert_vllm_names_restored_under_ours(result["names"])


def test_wrapper_below_vllm_ascends_does_not_call_itself(forked_probe):
    """Ours installed before vllm-ascend's patch (which then wraps it): no recursion, either way.

    Regression: ours used to call "what is there now" when not on top, i.e. vllm-ascend's
    wrapper, which calls ours again (RecursionError in every engine core, balance off included).
    """
    with vllm_ascend_in_this_process("ascend-first"):
        registry.RUN_ENGINE_CORE_WRAPPER.install()
        import vllm_ascend.patch.platform  # noqa: F401  (its wrappers now capture ours)

        assert launch_engine_core("fork", dp_config({}), forked_probe)["engine_core"] == (
            "DPEngineCoreProc"
        )
        reach = vllm_name_facts()["run_engine_core_reach"]
        assert reach[-2:] == [OUR_RUN_ENGINE_CORE, VLLM_RUN_ENGINE_CORE], reach
        result = launch_engine_core("fork", dp_config(TAKE_OVER), forked_probe)
        assert_balance_classes_built(result)
        assert_vllm_names_restored_under_ours(result["names"])


# The full launcher: front end, DP coordinator and engine processes of vLLM's own


def run_front_end(order: str, options: dict, method: str) -> dict:
    """``tests/multiproc/entrypoint.py`` in a fresh interpreter, with the stand-in in ``order``."""
    code = textwrap.dedent(
        f"""
        import runpy, sys
        sys.path.insert(0, {ROOT!r})
        from tests.vllm_ascend_standin import put_on_path
        put_on_path({order!r})
        sys.argv = ["entrypoint", "2", {json.dumps(options)!r}]
        runpy.run_module("tests.multiproc.entrypoint", run_name="__main__")
        """
    )
    env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD=method)
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [x for x in run.stdout.splitlines() if x.startswith("ENTRYPOINT-RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads(lines[-1].removeprefix("ENTRYPOINT-RESULT "))


@pytest.mark.slow  # ~1.5 min (fork) and ~4 min (spawn) on the loaded 2-core machine: nox -s soak
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "order, method", [("ascend-first", "fork"), ("ours-first", "spawn")], ids=lambda x: x
)
def test_full_launcher_engine_processes_run_ours_with_vllm_names_restored(order, method):
    result = run_front_end(order, {"additional_config": {TAKE_OVER_KEY: True}}, method)
    assert result["tokens"] == result["expected"]
    assert [facts["dp_rank"] for facts in result["facts"]] == [0, 1]
    for facts in result["facts"]:
        assert facts["engine_core_cls"] == "BalanceDPEngineCoreProc", facts
        assert facts["scheduler_mro"][0].startswith("vllm_balance."), facts
        assert not vllm_ascend_in(facts["engine_core_mro"] + facts["scheduler_mro"]), facts
        assert facts["scheduler_has_dp_group"] and len(facts["balance_queue"]) == 2, facts
        # After EngineCore.__init__ loaded the general plugins again (vllm-ascend's among them):
        assert_vllm_names_restored_under_ours(facts["names"])
