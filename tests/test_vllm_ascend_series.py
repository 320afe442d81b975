"""The vllm-ascend series (upstream_patch/vllm-ascend/): its form, and vllm-ascend after it.

What runs everywhere: the files carry no invented identity, the patched
``patch_balance_schedule.py`` is small and swaps nothing, export and apply are inverses. Where the
installed vLLM is one a pinned vllm-ascend release targets and a series is based on that release
(``upstream_patch/vllm-ascend/v<release>/``), the series is applied to the release's own source
(its sdist made a git tree) and engine cores started like vLLM's launcher run this package's
classes with nothing but the key (``tests/vllm_ascend_standin.py``; elsewhere they skip saying why).
"""

from __future__ import annotations

import ast
import re

import factories
import pytest
from engine_probe import launch_engine_core
from vllm_ascend_standin import (
    ORDERS,
    FrontEnd,
    load_series_module,
    prepared_root,
    release_for_installed_vllm,
    series_for,
    skip_reason,
    vllm_ascend_in,
)

series = load_series_module()
NESTED = {"scheduler_config": {"enable_balance_scheduling": True}}
VLLM_RUN_ENGINE_CORE = "vllm.v1.engine.core.EngineCoreProc.run_engine_core"
OUR_RUN_ENGINE_CORE = "vllm_balance.activation.balance_run_engine_core"
SERIES = series.all_series()


def test_one_series_per_base_commit_and_release():
    assert [d.name for d in SERIES] == [series.BASE_COMMIT[:8], "v0.30.0rc2"]


@pytest.mark.parametrize("directory", SERIES, ids=lambda d: d.name)
def test_series_names_nobody_as_author(directory):
    assert len(series.patches(directory)) == 2
    for patch in series.patches(directory):
        text = patch.read_text()
        header = re.compile(r"^(From[ :]|Date:|Author:|Signed-off-by:)", re.M)
        assert not header.search(text), patch.name
        assert series.commit_message(patch).startswith("[Scheduler] "), patch.name


@pytest.mark.parametrize("directory", SERIES, ids=lambda d: d.name)
def test_patched_balance_module_is_small_and_swaps_no_name(directory):
    text = series.post_image(series.BALANCE_MODULE, directory)
    assert len(text.splitlines()) <= 60
    assignments = [
        node
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) for t in node.targets)
    ]
    assert assignments == []


@pytest.mark.parametrize("directory", SERIES, ids=lambda d: d.name)
def test_series_rewrites_are_the_only_sections_without_old_lines(directory):
    """Only the two whole-file rewrites omit their old text; every other section is a diff."""
    rewritten = []
    for patch in series.patches(directory):
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


@pytest.fixture(scope="module")
def delegating_root():
    """The pinned release for the installed vLLM with its series applied, ready to import."""
    pin = release_for_installed_vllm()
    if pin is None:
        pytest.skip(skip_reason())
    directory = series_for(pin.release)
    if directory is None:
        names = ", ".join(d.name for d in SERIES)
        pytest.skip(f"no series is based on vllm-ascend {pin.release} (series: {names})")
    return prepared_root(pin.release, pin.vllm, directory)


@pytest.mark.parametrize("order", ORDERS)
def test_after_the_series_the_key_alone_runs_ours_with_ascend_config_initialised(
    delegating_root, forked_probe, order
):
    config = factories.make_vllm_config(moe=True, data_parallel_size=2, additional_config=NESTED)
    target = FrontEnd(order, str(delegating_root), forked_probe)
    result = launch_engine_core("fork", config, forked_probe, target=target)
    assert result["engine_core"] == "BalanceDPEngineCoreProc", result
    assert result["scheduler_mro"][0].startswith("vllm_balance."), result
    assert not vllm_ascend_in(result["engine_core_mro"] + result["scheduler_mro"]), result
    names = result["names"]
    assert names["Scheduler"] == "vllm.v1.core.sched.scheduler.Scheduler", names
    reach = names["run_engine_core_reach"]
    assert reach.count(OUR_RUN_ENGINE_CORE) == 1, reach  # vllm-ascend's wrapper on top is fine
    assert reach[-2:] == [OUR_RUN_ENGINE_CORE, VLLM_RUN_ENGINE_CORE], reach
    assert names["ascend_config"] == {"enable_balance_scheduling": True}, names
