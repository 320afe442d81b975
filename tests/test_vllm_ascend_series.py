"""The vllm-ascend series (upstream_patch/vllm-ascend/): their form, and vllm-ascend after them.

What runs everywhere: every series file is an mbox message ``git am`` reads, with a placeholder
author and no sign-off; only the pause-state series rewrites a file whole (the one holding the
``schedule()`` copy, which it deletes); export, apply and ``git am`` agree on a scratch repository.

Where the installed vLLM is one a pinned vllm-ascend release targets (``tests-release``): the
release's own source with the pause-state series applied passes vllm-ascend's own balance tests
(its differential against upstream's one-step ``PAUSED_NEW`` and its negative controls included),
and vllm-ascend's profiler and metric hooks see every step. vllm-ascend's tests run in child
processes (``run_ut.run_file``: one import of vllm-ascend per process).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess

import pytest

from balance_testbed.vllm_ascend_standin import (
    REPO,
    load_series_module,
    load_vllm_ascend_script,
    release_for_installed_vllm,
    sdist_tree,
    series_for,
    skip_reason,
)

series = load_series_module()
SERIES = series.all_series()
BALANCE_TESTS = "tests/ut/patch/platform/test_patch_balance_schedule.py"
# vllm-ascend's PR title prefixes (docs/source/developer_guide/contribution/index.md).
TITLE_PREFIXES = ("Attention", "Communicator", "ModelRunner", "Platform", "Worker", "Core",
                  "Kernel", "BugFix", "Doc", "Test", "CI", "Misc")  # fmt: skip
IDENTITY = ("-c", "user.name=t", "-c", "user.email=t@localhost")


def ran(run_ut, tree, path, *args) -> dict:
    """``run_ut.run_file``'s counts without the zero ones: ``{"passed": 20}``."""
    return {k: v for k, v in run_ut.run_file(tree, path, *args).items() if v}


def name(directory) -> str:
    return f"{directory.parent.name}/{directory.name}"


def test_one_series_per_pull_request_and_base():
    assert [name(d) for d in SERIES] == [
        f"{series.BASE_COMMIT[:8]}/srf",
        "v0.30.0rc2/pause-state",
        "v0.30.0rc2/srf",
    ]


@pytest.mark.parametrize("directory", SERIES, ids=name)
def test_series_files_are_mbox_messages_with_a_placeholder_author(directory):
    for patch in series.patches(directory):
        text = series.read_patch(patch)
        headers = text.partition("\n\n")[0].splitlines()
        assert headers[:3] == [
            series.MBOX_FROM,
            f"From: {series.PLACEHOLDER_AUTHOR}",
            f"Date: {series.FIXED_DATE}",
        ], patch.name
        assert "Signed-off-by:" not in text, patch.name
        title = series.commit_message(patch).splitlines()[0]
        prefixes = re.match(r"^((?:\[\w+\])+) ", title)
        assert prefixes, title
        assert set(re.findall(r"\[(\w+)\]", prefixes.group(1))) <= set(TITLE_PREFIXES), title


@pytest.mark.parametrize("directory", SERIES, ids=name)
def test_only_pause_state_rewrites_a_file_whole_and_only_the_copy(directory):
    """A rewrite is the one section ``git am`` cannot read: only where the old text is
    vllm-ascend's ``schedule()`` copy (vLLM's text, which stays out of this repository)."""
    rewritten = []
    for patch in series.patches(directory):
        rewrites, rest = series.split_rewrites(series.read_patch(patch))
        rewritten += [r.path for r in rewrites]
        assert "@@ -?,?" not in rest, patch.name
    assert rewritten == ([series.BALANCE_MODULE] if directory.name == "pause-state" else [])


@pytest.mark.parametrize("directory", [d for d in SERIES if d.name == "pause-state"], ids=name)
def test_pause_state_balance_scheduler_holds_on_paused_new_and_copies_nothing(directory):
    module = ast.parse(series.post_image(series.BALANCE_MODULE, directory))
    classes = {n.name: n for n in module.body if isinstance(n, ast.ClassDef)}
    [schedule] = [
        n for n in classes["BalanceScheduler"].body
        if isinstance(n, ast.FunctionDef) and n.name == "schedule"
    ]  # fmt: skip
    assert schedule.end_lineno - schedule.lineno < 20
    assert "PAUSED_NEW" in ast.unparse(schedule)
    calls = [ast.unparse(n.func) for n in ast.walk(module) if isinstance(n, ast.Call)]
    assert not [c for c in calls if c.endswith("set_pause_state")]  # it logs at INFO
    assert [ast.unparse(b) for b in classes["BalanceAsyncScheduler"].bases] == [
        "BalanceScheduler",
        "AsyncScheduler",
    ]
    assert not [n for n in ast.walk(module) if isinstance(n, ast.While)]  # no scheduling loop
    imports = [n for n in ast.walk(module) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [ast.unparse(n) for n in imports if "vllm_balance" in ast.unparse(n)]


def _scratch_repo(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    series.git(source, "init", "-q")
    (source / "kept.py").write_text("".join(f"line_{i} = {i}\n" for i in range(30)))
    (source / "crlf.py").write_bytes(b"".join(b"c_%d = %d\r\n" % (i, i) for i in range(30)))
    (source / "rewritten.py").write_text("".join(f"old_{i} = {i}  # before\n" for i in range(30)))
    series.git(source, "add", "-A")
    series.git(source, *IDENTITY, "commit", "-qm", "base")
    return source, series.git(source, "rev-parse", "HEAD").stdout.strip()


def _tree(repo) -> str:
    return series.git(repo, "rev-parse", "HEAD^{tree}").stdout


def test_export_apply_and_git_am_give_back_the_same_commits(tmp_path):
    """``apply.py --export`` and ``apply.py`` are inverses, whole-file rewrites included; the
    exported files without a rewrite are what ``git am`` applies, and a series with one
    becomes so through ``expand_rewrites`` (``apply.py --mbox``). CRLF lines survive both."""
    source, base = _scratch_repo(tmp_path)
    (source / "kept.py").write_text((source / "kept.py").read_text().replace("_7 = 7", "_7 = 8"))
    crlf = (source / "crlf.py").read_bytes().replace(b"c_3 = 3\r\n", b"c_3 = 4\r\n")
    (source / "crlf.py").write_bytes(crlf)
    series.git(source, *IDENTITY, "commit", "-qam", "[Core] Change two lines\n\nWhy.")
    # Both sides large enough for git's rewrite detection (-B skips small files).
    (source / "rewritten.py").write_text("".join(f"new_{i} = {-i}  # after\n" for i in range(30)))
    series.git(source, *IDENTITY, "commit", "-qam", "[Test][Core] Rewrite a file whole")

    exported = series.export_series(source, base, tmp_path / "series")
    assert [series.split_rewrites(series.read_patch(p))[0] != [] for p in exported] == [
        False,
        True,
    ]
    target = tmp_path / "target"
    series.git(source, "clone", "-q", str(source), str(target))
    series.git(target, "checkout", "-q", base)
    series.apply_series(target, IDENTITY, exported)
    assert _tree(target) == _tree(source)
    assert series.git(target, "log", "-1", "--format=%s").stdout.strip() == (
        "[Test][Core] Rewrite a file whole"
    )
    again = series.export_series(target, base, tmp_path / "again")
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in exported]

    series.git(target, "checkout", "-q", base)
    assert series.git_am(target, exported[:1]).returncode == 0  # no rewrite: as it is
    series.git(target, "checkout", "-q", base)
    assert series.git_am(target, exported).returncode != 0  # a rewrite section: git am refuses
    series.git(target, "am", "--abort")
    expanded = series.expand_rewrites(target, exported, tmp_path / "mbox")
    am = series.git_am(target, expanded)
    assert am.returncode == 0, am.stderr
    assert _tree(target) == _tree(source)
    assert series.git(target, "log", "-2", "--format=%s").stdout.splitlines() == [
        "[Test][Core] Rewrite a file whole",
        "[Core] Change two lines",
    ]

    # Negative control: a rewrite whose pre-image blob differs is refused, nothing applied.
    series.git(target, "reset", "-q", "--hard", base)
    (target / "rewritten.py").write_text("changed = 0\n")
    series.git(target, *IDENTITY, "commit", "-qam", "diverged")
    with pytest.raises(series.PatchError, match="rewritten.py is"):
        series.apply_series(target, IDENTITY, exported)
    assert series.git(target, "log", "-1", "--format=%s").stdout.strip() == "diverged"


def test_apply_py_runs_from_a_plain_python_without_pythonpath(tmp_path):
    source, base = _scratch_repo(tmp_path)
    run = subprocess.run(
        ["python3", "-E", "-s", str(REPO / "upstream_patch/vllm-ascend/apply.py"), str(source),
         "--pr", "srf", "--base", "v0.30.0rc2", "--check"],
        capture_output=True, text=True,
    )  # fmt: skip
    # -E -s: no PYTHONPATH, no user site; the series does not apply to a scratch tree, which is
    # the one-line refusal, not an ImportError.
    assert "not applied:" in run.stderr and "Error" not in run.stderr, run.stderr


# vllm-ascend's own source, on the vLLM it targets


@pytest.fixture(scope="module")
def release():
    pin = release_for_installed_vllm()
    if pin is None:
        pytest.skip(skip_reason())
    if series_for(pin.release, "pause-state") is None:
        pytest.skip(f"no pause-state series is based on vllm-ascend {pin.release}")
    return pin


@pytest.fixture(scope="module")
def run_ut():
    return load_vllm_ascend_script("run_ut")


@pytest.fixture(scope="module")
def pause_state_tree(release, tmp_path_factory, run_ut):
    """The release's sdist with the pause-state series applied (its copy of ``schedule()`` gone)."""
    tree = sdist_tree(release.release, tmp_path_factory.mktemp("pause-state"))
    series.apply_series(tree, IDENTITY, series.patches(series_for(release.release, "pause-state")))
    run_ut.write_build_info(tree)
    return tree


def test_pause_state_series_passes_vllm_ascends_balance_tests(pause_state_tree, run_ut):
    """Their differential (a frozen step is upstream's one-step PAUSED_NEW, sync and async), its
    negative controls (a pause kept one step too long, PAUSED_ALL, ``>= cap - 1``), and the rest
    of their balance file."""
    counts = ran(run_ut, pause_state_tree, BALANCE_TESTS)
    assert counts.get("passed", 0) >= 30 and set(counts) == {"passed"}, counts
    assert ran(run_ut, pause_state_tree, BALANCE_TESTS, "-k", "negative_control") == {"passed": 3}


def test_profiler_and_metric_hooks_see_every_step_under_the_pause_state_hold(
    pause_state_tree, run_ut
):
    probe = pause_state_tree / "tests/ut/test_balance_hooks_probe.py"
    shutil.copyfile(REPO / "tests/vllm_ascend_hooks_probe.py", probe)
    assert ran(run_ut, pause_state_tree, str(probe.relative_to(pause_state_tree))) == {"passed": 2}


def test_the_pause_state_pr_imports_nothing_of_this_package(pause_state_tree, run_ut):
    """After vllm-ascend's config init and a frozen step, ``sys.modules`` holds no module of this
    repository (tests/vllm_ascend_imports_probe.py; an ``import vllm_balance`` added to their
    module fails it)."""
    probe = pause_state_tree / "tests/ut/test_balance_imports_probe.py"
    shutil.copyfile(REPO / "tests/vllm_ascend_imports_probe.py", probe)
    assert ran(run_ut, pause_state_tree, str(probe.relative_to(pause_state_tree))) == {"passed": 1}
