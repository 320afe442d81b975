"""The vllm-ascend series (upstream_patch/vllm-ascend/): its form, and vllm-ascend after it.

The series cannot be applied here (vllm-ascend's source is not in this repository; apply and
export it with the commands in upstream_patch/vllm-ascend/README.md). What runs here: the files
carry no invented identity, the patched ``patch_balance_schedule.py`` is small and swaps nothing,
and that very module, put into the vllm-ascend stand-in, lets engine cores started like vLLM's
launcher run this package's classes with nothing but the key.
"""

from __future__ import annotations

import ast
import logging
import re

import factories
import pytest
import vllm.plugins
from engine_probe import launch_engine_core
from vllm_ascend_standin import (
    ORDERS,
    delegating_root,
    load_series_module,
    vllm_ascend_in,
    vllm_ascend_in_this_process,
    vllm_name_facts,
)

series = load_series_module()
ENABLED = {"enable_balance_scheduling": True}
VLLM_RUN_ENGINE_CORE = "vllm.v1.engine.core.EngineCoreProc.run_engine_core"
OUR_RUN_ENGINE_CORE = "vllm_balance.activation.balance_run_engine_core"


def test_series_names_its_base_commit_and_nobody_as_author():
    assert re.fullmatch(r"[0-9a-f]{40}", series.BASE_COMMIT)
    assert series.SERIES_DIR.name == series.BASE_COMMIT[:8]
    assert len(series.patches()) == 2
    for patch in series.patches():
        text = patch.read_text()
        header = re.compile(r"^(From[ :]|Date:|Author:|Signed-off-by:)", re.M)
        assert not header.search(text), patch.name
        assert series.commit_message(patch).startswith("[Scheduler] "), patch.name


def test_patched_balance_module_is_small_and_swaps_no_name():
    text = series.post_image(series.BALANCE_MODULE)
    assert len(text.splitlines()) <= 60
    assignments = [
        node
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) for t in node.targets)
    ]
    assert assignments == []


def test_series_rewrites_are_the_only_sections_without_old_lines():
    """Only the two whole-file rewrites omit their old text; every other section is a diff."""
    rewritten = []
    for patch in series.patches():
        rewrites, rest = series.split_rewrites(patch.read_text())
        rewritten += [r.path for r in rewrites]
        assert "@@ -?,?" not in rest, patch.name
    assert sorted(rewritten) == sorted(
        [series.BALANCE_MODULE, "tests/ut/patch/platform/test_patch_balance_schedule.py"]
    )


def test_export_then_apply_gives_back_the_same_commits(tmp_path):
    """``apply.py --export`` and ``apply.py`` are inverses, whole-file rewrites included: the
    applied tree equals the exported one, and exporting it again gives the same bytes."""
    source, target = tmp_path / "source", tmp_path / "target"
    identity = ("-c", "user.name=t", "-c", "user.email=t@localhost")
    source.mkdir()
    series.git(source, "init", "-q")
    (source / "kept.py").write_text("".join(f"line_{i} = {i}\n" for i in range(30)))
    (source / "rewritten.py").write_text("".join(f"old_{i} = {i}  # before\n" for i in range(30)))
    series.git(source, "add", "-A")
    series.git(source, *identity, "commit", "-qm", "base")
    base = series.git(source, "rev-parse", "HEAD").stdout.strip()
    series.git(source, "clone", "-q", str(source), str(target))
    (source / "kept.py").write_text((source / "kept.py").read_text().replace("_7 = 7", "_7 = 8"))
    series.git(source, *identity, "commit", "-qam", "[Core] Change one line\n\nWhy.")
    # Both sides large enough for git's rewrite detection (-B skips small files).
    (source / "rewritten.py").write_text("".join(f"new_{i} = {-i}  # after\n" for i in range(30)))
    series.git(source, *identity, "commit", "-qam", "[Core] Rewrite a file whole")

    exported = series.export_series(source, base, tmp_path / "series")
    assert [series.split_rewrites(p.read_text())[0] != [] for p in exported] == [False, True]
    series.apply_series(target, identity, exported)
    assert (
        series.git(target, "rev-parse", "HEAD^{tree}").stdout
        == series.git(source, "rev-parse", "HEAD^{tree}").stdout
    )
    again = series.export_series(target, base, tmp_path / "again")
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in exported]

    # Negative control: a rewrite whose pre-image blob differs is refused, nothing applied.
    series.git(target, "reset", "-q", "--hard", base)
    (target / "rewritten.py").write_text("changed = 0\n")
    series.git(target, *identity, "commit", "-qam", "diverged")
    with pytest.raises(series.PatchError, match="rewritten.py is"):
        series.apply_series(target, identity, exported)
    assert series.git(target, "log", "-1", "--format=%s").stdout.strip() == "diverged"


@pytest.fixture(params=ORDERS)
def delegating_ascend(request, tmp_path):
    with vllm_ascend_in_this_process(request.param, delegating_root(tmp_path)):
        vllm.plugins.load_general_plugins()
        yield request.param


def test_after_the_series_vllm_ascend_swaps_nothing_and_our_wrapper_is_called_once(
    delegating_ascend,
):
    names = vllm_name_facts()
    assert names["Scheduler"] == "vllm.v1.core.sched.scheduler.Scheduler"
    reach = names["run_engine_core_reach"]
    assert reach.count(OUR_RUN_ENGINE_CORE) == 1, reach  # DyntraLB's pass-through on top is fine
    assert reach[-2:] == [OUR_RUN_ENGINE_CORE, VLLM_RUN_ENGINE_CORE], reach


def test_after_the_series_the_key_alone_runs_ours_in_engine_cores(
    delegating_ascend, forked_probe, caplog
):
    config = factories.make_vllm_config(moe=True, data_parallel_size=2, additional_config=ENABLED)
    with caplog.at_level(logging.INFO, logger="vllm_balance"):
        result = launch_engine_core("fork", config, forked_probe)
    assert result["engine_core"] == "BalanceDPEngineCoreProc", result
    assert result["scheduler_mro"][0].startswith("vllm_balance."), result
    assert not vllm_ascend_in(result["engine_core_mro"] + result["scheduler_mro"]), result
    assert result["names"]["Scheduler"] == "vllm.v1.core.sched.scheduler.Scheduler"
