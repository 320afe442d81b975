"""Take-over mode: this package next to vllm-ascend's own balance patch (vllm_balance/ascend/).

Run against vllm-ascend's own released source (``balance_testbed.vllm_ascend_standin``: the
release of ``pins/vllm-ascend.txt`` that targets the installed vLLM; elsewhere these tests skip
with that reason). vLLM's own ``load_general_plugins()`` loads vllm-ascend's plugins, which
apply all of its platform patches, before or after this package depending on ``sys.path``
(both orders below).
Every case is an engine core started the way vLLM's launcher starts it
(``engine_probe.launch_engine_core``): forked from a ``FrontEnd`` that loaded the plugins, or
spawned; it reports what it built and where vLLM's names point. The test process itself never
imports vllm-ascend (a second import in one process fails).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from vllm.v1.engine.core import EngineCoreProc

from balance_testbed import factories
from balance_testbed.engine_probe import launch_engine_core
from balance_testbed.vllm_ascend_standin import (
    ORDERS,
    OUR_PLUGIN,
    FrontEnd,
    ProbedTarget,
    front_end_facts,
    on_path,
    prepared_root,
    release_for_installed_vllm,
    skip_reason,
    vllm_ascend_in,
)
from vllm_balance import activation, plugin, registry
from vllm_balance.config import TAKE_OVER_ENV_VAR, TAKE_OVER_KEY, balance_options
from vllm_balance.log import LOGGER_NAME

# The take-over's mechanics; which hold runs after it is the selection, tested on each path.
pytestmark = pytest.mark.path_independent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NESTED = {"scheduler_config": {"enable_balance_scheduling": True}}
ENABLED = {"enable_balance_scheduling": True}
# vllm-ascend >= 0.27.1rc1 refuses additional_config keys it does not know (extra="forbid"), ours
# included: the opt-in comes from the environment (the key is tested without vllm-ascend).
TAKE_OVER = NESTED
VLLM_RUN_ENGINE_CORE = "vllm.v1.engine.core.EngineCoreProc.run_engine_core"
OUR_RUN_ENGINE_CORE = "vllm_balance.activation.balance_run_engine_core"
ASCEND_SCHEDULER = "vllm_ascend.patch.platform.patch_balance_schedule.BalanceScheduler"
TAKE_OVER_LINE = (
    f"balance scheduling takes over from vllm-ascend's own balance patch ({TAKE_OVER_KEY}): "
    "vLLM's Scheduler, AsyncScheduler, DPEngineCoreProc and run_engine_core restored (were: "
    f"vllm.v1.core.sched.scheduler.Scheduler -> {ASCEND_SCHEDULER}; "
)


def dp_config(additional_config, **kwargs):
    return factories.make_vllm_config(
        moe=True, data_parallel_size=2, additional_config=dict(additional_config), **kwargs
    )


@pytest.fixture(scope="module")
def vllm_ascend_root():
    """The vllm-ascend release for the installed vLLM, unpacked and ready to import."""
    pin = release_for_installed_vllm()
    if pin is None:
        pytest.skip(skip_reason())
    return prepared_root(pin.release, pin.vllm)


@pytest.fixture
def fork_engine_core(vllm_ascend_root, forked_probe, monkeypatch):
    """Start a fork engine core behind a ``FrontEnd``; returns (front end facts, engine core
    report). ``opt_in``: the take-over opt-in in the environment. A refusing engine core raises
    ``AssertionError`` ("without a probe report")."""

    def start(order, additional_config, config_kwargs=None, opt_in=True, **front_end):
        if opt_in:
            monkeypatch.setenv(TAKE_OVER_ENV_VAR, "1")
        config = dp_config(additional_config, **(config_kwargs or {}))
        target = FrontEnd(order, str(vllm_ascend_root), forked_probe, **front_end)
        result = launch_engine_core("fork", config, forked_probe, target=target)
        return front_end_facts(forked_probe), result

    return start


def logged(capfd) -> str:
    """What the children wrote (a refusing child's traceback is on stderr)."""
    captured = capfd.readouterr()
    return captured.out + captured.err


def assert_vllm_names_restored_under_ours(names):
    assert names["Scheduler"] == "vllm.v1.core.sched.scheduler.Scheduler", names
    assert names["run_engine_core_reach"] == [OUR_RUN_ENGINE_CORE, VLLM_RUN_ENGINE_CORE], names
    assert not vllm_ascend_in(names["AsyncScheduler_mro"]), names
    assert not vllm_ascend_in(names["DPEngineCoreProc_mro"]), names


def assert_balance_classes_built(report):
    assert report["engine_core"] == "BalanceDPEngineCoreProc", report
    assert report["scheduler_mro"][0].startswith("vllm_balance."), report
    assert not vllm_ascend_in(report["engine_core_mro"] + report["scheduler_mro"]), report


def assert_vllm_ascend_alone(report):
    """vllm-ascend's patch decided alone: its wrapper kept vLLM's DPEngineCoreProc (balance off)
    and its Scheduler swap is in place."""
    assert report["engine_core"] == "DPEngineCoreProc", report
    assert report["scheduler_cls"] is None, report
    assert report["names"]["Scheduler"] == ASCEND_SCHEDULER, report


# The front end: plugin order, and what balance off leaves


@pytest.mark.parametrize("order", ORDERS)
def test_our_wrapper_is_outermost_whatever_the_plugin_order_and_balance_off_is_vllm_ascends(
    fork_engine_core, order
):
    """The launcher's target is what is on top: ours must be there for the take-over to run."""
    front, result = fork_engine_core(order, {})
    plugins = front["plugins"]
    ours, theirs = plugins.index(OUR_PLUGIN), plugins.index("ascend_kv_connector")
    assert (ours > theirs) if order == "ascend-first" else (ours < theirs), plugins
    reach = front["names"]["run_engine_core_reach"]
    assert reach[0] == OUR_RUN_ENGINE_CORE and reach[-1] == VLLM_RUN_ENGINE_CORE, reach
    assert vllm_ascend_in(reach), reach  # vllm-ascend's wrappers are still below ours
    assert front["names"]["Scheduler"] == ASCEND_SCHEDULER
    assert_vllm_ascend_alone(result)


# Take-over in engine cores, fork and spawn, both plugin orders


@pytest.mark.parametrize("order", ORDERS)
def test_fork_engine_core_takes_over_and_initialises_ascend_config(fork_engine_core, order):
    front, result = fork_engine_core(order, TAKE_OVER)
    assert_balance_classes_built(result)
    assert_vllm_names_restored_under_ours(result["names"])
    # What vllm-ascend's removed code did in this process: other vllm-ascend code reads it.
    assert result["names"]["ascend_config"] == {"enable_balance_scheduling": True}, result
    [line] = [x for x in result["names"]["balance_log"] if "takes over" in x]
    assert TAKE_OVER_LINE in line, line


TAKEN_OVER = {
    "vllm.v1.core.sched.scheduler.Scheduler",
    "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
    "vllm.v1.engine.core.DPEngineCoreProc",
    "vllm.v1.engine.core.EngineCoreProc.run_engine_core",
}


@pytest.mark.parametrize("order", ORDERS)
def test_take_over_removes_its_four_names_and_keeps_every_other_vllm_ascend_patch(
    fork_engine_core, order
):
    """vllm-ascend replaces 31 (0.27.1rc1) or 35 (0.30.0rc2) vLLM names (config validators,
    KV-cache planning, pp-MTP, profiling chunk, ...): the take-over gives back only those of its
    balance patch."""
    front, result = fork_engine_core(order, TAKE_OVER)
    assert_balance_classes_built(result)
    before = set(front["names"]["vllm_ascend_patches"])
    after = set(result["names"]["vllm_ascend_patches"])
    assert {p.split(" -> ")[0] for p in before - after} <= TAKEN_OVER, before - after
    assert {p.split(" -> ")[0] for p in after - before} == set(), after - before
    assert len(before - after) >= 1 and len(after) >= 5, (before, after)  # Scheduler at least


@pytest.mark.parametrize("order", ORDERS)
def test_spawn_engine_core_takes_over_and_vllm_names_stay_restored_after_its_plugins_load(
    vllm_ascend_root, tmp_path, monkeypatch, order
):
    """A fresh interpreter loads vllm-ascend's plugins only inside ``EngineCore.__init__``, after
    ``run_engine_core`` chose the engine core: our wrapper (the launcher's target, pickled by
    name) applies them first, so that the take-over sees them and loading them later changes
    nothing. The test process loads only ours."""
    monkeypatch.setenv(TAKE_OVER_ENV_VAR, "1")
    registry.uninstall_all()
    plugin.register()
    report = str(tmp_path / "report.json")
    target = ProbedTarget(report, EngineCoreProc.run_engine_core)
    try:
        with on_path(order, vllm_ascend_root):
            result = launch_engine_core("spawn", dp_config(TAKE_OVER), report, target=target)
    finally:
        registry.uninstall_all()
    assert_balance_classes_built(result)
    assert_vllm_names_restored_under_ours(result["names"])
    assert result["names"]["ascend_config"] == {"enable_balance_scheduling": True}, result


# Refusals and config sources


def test_without_the_opt_in_vllm_ascends_own_balance_runs_its_srf_included(fork_engine_core):
    """No opt-in: this package steps aside and says so; vllm-ascend's balance runs as it ships
    it, ShortRequestFirst included (nothing of theirs is refused)."""
    srf = {"short_request_first_config": {"enabled": True}}
    config = {"scheduler_config": {**NESTED["scheduler_config"], **srf}}
    _, result = fork_engine_core("ascend-first", config, opt_in=False)
    assert result["engine_core_mro"][0].startswith("vllm_ascend."), result
    assert result["names"]["Scheduler"] == ASCEND_SCHEDULER, result
    [line] = [x for x in result["names"]["balance_log"] if "already patched in" in x]
    assert f"vllm.v1.core.sched.scheduler.Scheduler -> {ASCEND_SCHEDULER}; " in line, line
    assert "own balance scheduling runs and this package installs nothing" in line, line


def test_vllm_ascend_refuses_this_packages_additional_config_keys(fork_engine_core, capfd):
    """Why the opt-in comes from the environment: vllm-ascend validates ``additional_config``
    with ``extra="forbid"`` (0.27.1rc1, 0.30.0rc2), so its own ``init_ascend_config`` fails on
    any key of this package (here in the engine core; on an NPU host its platform already fails
    in the front end)."""
    with pytest.raises(AssertionError, match="without a probe report"):
        fork_engine_core("ascend-first", {**NESTED, TAKE_OVER_KEY: True}, opt_in=False)
    err = logged(capfd)
    assert f"{TAKE_OVER_KEY}\n  Unexpected keyword argument" in err, err[-2000:]


@pytest.mark.parametrize(
    "key", ["short_request_first_config", "dyntra_lb_config"], ids=["srf", "dyntra-lb"]
)
def test_take_over_refuses_to_drop_a_vllm_ascend_feature_it_would_remove(
    fork_engine_core, capfd, key
):
    config = {
        **TAKE_OVER,
        "scheduler_config": {"enable_balance_scheduling": True, key: {"enabled": True}},
    }
    with pytest.raises(AssertionError, match="without a probe report"):
        fork_engine_core("ascend-first", config)
    assert f"{TAKE_OVER_KEY} cannot keep vllm-ascend's {key}" in logged(capfd)


def test_dyntra_lb_without_balance_is_left_to_vllm_ascend(fork_engine_core):
    dyntra_lb = {"scheduler_config": {"dyntra_lb_config": {"enabled": True}}}
    _, result = fork_engine_core("ascend-first", dyntra_lb)
    assert result["engine_core"] == "DyntraLBDPEngineCoreProc", result
    assert result["scheduler_cls"] is None, result


@pytest.mark.parametrize(
    "additional_config",
    [ENABLED, NESTED],
    ids=["top-level-key", "nested-key"],
)
def test_both_keys_reach_the_take_over_through_ascend_config(fork_engine_core, additional_config):
    """The front end initialised vllm-ascend's config (as its platform does on an NPU host), so
    ``AscendConfig`` is what this package reads first in the engine core."""
    _, result = fork_engine_core("ours-first", additional_config, init_ascend_config=True)
    assert_balance_classes_built(result)
    assert result["names"]["ascend_config"] == {"enable_balance_scheduling": True}


def test_deprecated_env_var_is_not_read_where_ascend_config_decides(
    fork_engine_core, monkeypatch, fresh_once_logs
):
    """vllm-ascend no longer reads ``VLLM_ASCEND_BALANCE_SCHEDULING``; its ``AscendConfig``
    decides here too (off), and says that the variable is ignored."""
    monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", "1")
    _, result = fork_engine_core("ascend-first", {})
    assert_vllm_ascend_alone(result)
    [line] = [x for x in result["names"]["balance_log"] if "VLLM_ASCEND_BALANCE" in x]
    assert "VLLM_ASCEND_BALANCE_SCHEDULING is not read: vllm-ascend's AscendConfig decides" in line


# Import orders that vllm-ascend's own front end produces


def test_async_scheduler_defined_on_vllm_ascends_class_is_rebuilt_for_ours(fork_engine_core):
    front, result = fork_engine_core(
        "ascend-first",
        TAKE_OVER,
        config_kwargs={"async_scheduling": True},
        fresh_async_scheduler=True,
    )
    assert ASCEND_SCHEDULER in front["names"]["AsyncScheduler_mro"], front
    assert "vllm.v1.core.sched.async_scheduler.AsyncScheduler" in result["scheduler_mro"]
    assert_balance_classes_built(result)
    assert_vllm_names_restored_under_ours(result["names"])


@pytest.mark.parametrize("additional_config", [{}, TAKE_OVER], ids=["balance-off", "take-over"])
def test_wrapper_below_vllm_ascends_does_not_call_itself(fork_engine_core, additional_config):
    """Ours installed before vllm-ascend's patches (which then wrap it): no recursion.

    Regression: ours used to call "what is there now" when not on top, i.e. vllm-ascend's
    wrapper, which calls ours again (RecursionError in every engine core, balance off included).
    """
    front, result = fork_engine_core("ascend-first", additional_config, ours_first_installed=True)
    reach = front["names"]["run_engine_core_reach"]
    assert reach[-2:] == [OUR_RUN_ENGINE_CORE, VLLM_RUN_ENGINE_CORE], reach
    if additional_config:
        assert_balance_classes_built(result)
        assert_vllm_names_restored_under_ours(result["names"])
    else:
        assert_vllm_ascend_alone(result)


# Without vllm-ascend (in this process)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_opt_in_must_be_a_boolean(value):
    config = dp_config({**ENABLED, TAKE_OVER_KEY: value})
    with pytest.raises(ValueError, match=f"additional_config.{TAKE_OVER_KEY} must be a boolean"):
        balance_options(config)


@pytest.mark.parametrize(
    "raw, expected", [("1", True), ("true", True), (" TRUE ", True), ("0", False), ("", False)]
)
def test_opt_in_from_the_environment(monkeypatch, raw, expected):
    monkeypatch.setenv(TAKE_OVER_ENV_VAR, raw)
    assert balance_options(dp_config(ENABLED)).take_over_vllm_ascend is expected


def test_opt_in_from_the_environment_must_be_0_1_true_false(monkeypatch):
    monkeypatch.setenv(TAKE_OVER_ENV_VAR, "yes")
    with pytest.raises(ValueError, match=f"{TAKE_OVER_ENV_VAR} must be 0/1/true/false, got 'yes'"):
        balance_options(dp_config(ENABLED))


@pytest.mark.parametrize("raw", ["1", "yes"])
def test_the_key_wins_over_the_environment(monkeypatch, raw):
    """Where the key decides, the variable is not read (not even to refuse a bad value)."""
    monkeypatch.setenv(TAKE_OVER_ENV_VAR, raw)
    config = dp_config({**ENABLED, TAKE_OVER_KEY: False})
    assert balance_options(config).take_over_vllm_ascend is False


def test_opt_in_without_vllm_ascend_warns_that_there_is_nothing_to_take_over(caplog):
    import logging

    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
            assert activation.activate_for(dp_config({**ENABLED, TAKE_OVER_KEY: True})) is True
    finally:
        registry.uninstall_all()
    expected = f"{TAKE_OVER_KEY} (or {TAKE_OVER_ENV_VAR}) is set but vllm-ascend's balance patch"
    assert f"{expected} is not active" in caplog.text


# The full launcher: front end, DP coordinator and engine processes of vLLM's own


def run_front_end(root, order: str, options: dict, method: str) -> dict:
    """``tests/multiproc/entrypoint.py`` in a fresh interpreter, with the release in ``order``
    (``-c`` from the repository root: ``tests`` imports as a package)."""
    code = textwrap.dedent(
        f"""
        import runpy, sys
        from pathlib import Path
        from balance_testbed.vllm_ascend_standin import put_on_path
        put_on_path({order!r}, Path({str(root)!r}))
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


@pytest.mark.slow  # minutes each on the loaded 2-core machine: nox -s takeover -- -m slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "order, method", [("ascend-first", "fork"), ("ours-first", "spawn")], ids=lambda x: x
)
def test_full_launcher_engine_processes_run_ours_with_vllm_names_restored(
    vllm_ascend_root, monkeypatch, order, method
):
    monkeypatch.setenv(TAKE_OVER_ENV_VAR, "1")
    result = run_front_end(vllm_ascend_root, order, {"additional_config": TAKE_OVER}, method)
    assert result["tokens"] == result["expected"]
    assert [facts["dp_rank"] for facts in result["facts"]] == [0, 1]
    for facts in result["facts"]:
        assert facts["engine_core_cls"] == "BalanceDPEngineCoreProc", facts
        assert facts["scheduler_mro"][0].startswith("vllm_balance."), facts
        assert not vllm_ascend_in(facts["engine_core_mro"] + facts["scheduler_mro"]), facts
        assert facts["scheduler_has_dp_group"] and facts["balance_dp_size"] == 2, facts
        # After EngineCore.__init__ loaded the general plugins again (vllm-ascend's among them):
        assert_vllm_names_restored_under_ours(facts["names"])
