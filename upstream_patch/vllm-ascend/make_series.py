"""Regenerate the vllm-ascend series: patch_balance_schedule.py delegates to this package.

    python upstream_patch/vllm-ascend/make_series.py --source <vllm-ascend git dir> [--check]

Takes the files the series touches from vllm-ascend at ``series.BASE_COMMIT`` (``git archive``),
commits them to a scratch repository, makes each commit's edits below and writes each commit as
``<message> --- <stat> <diff>`` (``series.py`` describes the format: no author, no sign-off).
Every edit names the exact text it replaces and must find it exactly once, so a vllm-ascend that
moved on fails loudly instead of producing a wrong series. Same base, same bytes: ``--check``
compares a regeneration with the committed files.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from series import (  # noqa: E402
    BALANCE_MODULE,
    BASE_COMMIT,
    SERIES_DIR,
    patches,
    render,
    split_rewrites,
)


@dataclass(frozen=True)
class Edit:
    path: str
    old: str  # "" with new: the whole file is replaced by new
    new: str


@dataclass(frozen=True)
class Commit:
    slug: str
    message: str
    edits: tuple[Edit, ...]


SRF_MODULE = "vllm_ascend/core/short_request_first_scheduler.py"
PLATFORM = "vllm_ascend/platform.py"
DYNTRA = "vllm_ascend/patch/platform/patch_dyntra_lb_core.py"
SRF_CLASS = "vllm_ascend.core.short_request_first_scheduler.ShortRequestFirstScheduler"

SRF_MESSAGE = """\
[Scheduler] Select ShortRequestFirst through scheduler_cls on the synchronous path too

### What this PR does / why we need it?

ShortRequestFirst (SRF) installs its waiting queue after the scheduler's own
__init__. On the asynchronous path platform._check_ascend_config selects
ShortRequestFirstAsyncScheduler through scheduler_cls. On the synchronous
path SRF relies on patch_balance_schedule.py, which replaces
vllm.v1.core.sched.scheduler.Scheduler in every process with its
BalanceScheduler, whose __init__ installs the queue.

Give the synchronous path its own class, ShortRequestFirstScheduler, selected
the same way; both classes share the installation in ShortRequestFirstMixin.
SRF then no longer depends on the global Scheduler swap, which the next
patch removes.

### Does this PR introduce _any_ user-facing change?

No. short_request_first_config behaves as before; scheduler_cls names the
SRF class on both paths.

### How was this patch tested?

Unit tests updated: tests/ut/test_platform.py expects
ShortRequestFirstScheduler where it expected no scheduler_cls, and the SRF
installation test covers both classes.
"""

DELEGATE_MESSAGE = """\
[Scheduler] Delegate balance scheduling to vllm-balance-scheduling

### What this PR does / why we need it?

patch_balance_schedule.py carries a copy of vLLM v0.24.0's 713-line
Scheduler.schedule() plus three balance deltas, replaces
vllm.v1.core.sched.scheduler.Scheduler in every process at import, and wraps
EngineCoreProc.run_engine_core. The copy goes stale with each vLLM pin (the
release-tag pin is v0.27.1 now) and its drift test skips unless vLLM is a
git checkout.

The vllm-balance-scheduling package implements the same behaviour (design
docs/source/developer_guide/Design_Documents/balance_schedule_refactor.md):
the all_gather of len(running) right after
DPEngineCoreProc._has_global_unfinished_reqs, and the gate "any DP rank at
max_num_running_reqs => no rank admits WAITING requests this step", on
vLLM's Scheduler._should_stop_admitting_waiting seam where vLLM has it and
on a schedule() derived from the installed vLLM where it does not, for
Scheduler and AsyncScheduler. It reads AscendConfig first, so the switch
stays vllm-ascend's: additional_config.scheduler_config.
enable_balance_scheduling, PD-mixed only.

This patch keeps the key and its checks and deletes the copy:
- patch_balance_schedule.py swaps no vLLM name; importing it registers the
  package's run_engine_core wrapper (as the package's own general plugin
  does; a no-op decision when balance is off), and
  check_balance_scheduling() makes a missing package a start-up error.
- platform._check_ascend_config calls it when balance is enabled, and
  rejects balance together with short_request_first_config (both select
  the scheduler class).
- DyntraLB calls the run_engine_core it wraps (the balance module no longer
  keeps vLLM's).
- The drift test goes: there is no copy. The metrics hook on
  BalanceScheduler.schedule goes with the class.

### Does this PR introduce _any_ user-facing change?

Balance scheduling needs `pip install vllm-balance-scheduling`; without it,
enabling balance scheduling fails at start-up with a message saying so.
short_request_first_config and enable_balance_scheduling can no longer be
combined.

### How was this patch tested?

Unit tests updated here. Behaviour: vllm-balance-scheduling's contract
suite and vLLM's own scheduler tests run on both of its paths at vLLM
0.24.0 and 0.25.0; see its docs/vllm-ascend-pr.md for the runs and the
NPU checks.
"""

NEW_BALANCE_MODULE = '''\
"""Balance scheduling for data-parallel MoE serving, delegated to vllm-balance-scheduling.

Every active engine step each DP rank all-gathers ``len(running)``; when any rank was at
``max_num_running_reqs``, no rank admits WAITING requests that step. vllm-ascend keeps the switch,
``additional_config.scheduler_config.enable_balance_scheduling`` (``AscendConfig`` is the first
source; PD-mixed only, checked in ``platform._check_ascend_config``). The implementation is the
vllm-balance-scheduling package: the gather right after
``DPEngineCoreProc._has_global_unfinished_reqs``, and the gate on vLLM's
``Scheduler._should_stop_admitting_waiting`` seam or, on vLLM releases without it, in a
``schedule()`` derived from the installed vLLM, never a copy.

This module swaps no vLLM name. Importing it registers the package's ``run_engine_core`` wrapper
(what the package's own general plugin does; idempotent), so that balance does not depend on
``VLLM_PLUGINS`` listing that plugin; with balance off the wrapper leaves every vLLM class as it
is. ``check_balance_scheduling()`` turns a missing package into a start-up error.
"""

try:
    from vllm_balance.plugin import register as _register_balance_scheduling
except ImportError:  # optional: needed only when balance scheduling is enabled
    _register_balance_scheduling = None

BALANCE_SCHEDULING_PACKAGE = "vllm-balance-scheduling"


def check_balance_scheduling() -> None:
    """Called by ``platform._check_ascend_config`` when balance scheduling is enabled."""
    if _register_balance_scheduling is None:
        raise ValueError(
            f"enable_balance_scheduling needs the {BALANCE_SCHEDULING_PACKAGE} package in the "
            f"serving environment: pip install {BALANCE_SCHEDULING_PACKAGE}"
        )


if _register_balance_scheduling is not None:
    _register_balance_scheduling()
'''

NEW_BALANCE_TEST = '''\
# SPDX-License-Identifier: Apache-2.0
"""patch_balance_schedule.py delegates balance scheduling: it swaps no vLLM name."""

import pytest
import vllm.v1.core.sched.scheduler as scheduler_module
import vllm.v1.engine.core as engine_core_module

import vllm_ascend.patch.platform.patch_balance_schedule as balance_patch


def test_no_vllm_class_is_swapped():
    assert scheduler_module.Scheduler.__module__ == "vllm.v1.core.sched.scheduler"
    assert engine_core_module.DPEngineCoreProc.__module__ == "vllm.v1.engine.core"


def test_missing_package_is_a_start_up_error(monkeypatch):
    monkeypatch.setattr(balance_patch, "_register_balance_scheduling", None)
    with pytest.raises(ValueError, match="pip install vllm-balance-scheduling"):
        balance_patch.check_balance_scheduling()


def test_installed_package_is_registered():
    plugin = pytest.importorskip("vllm_balance.plugin")
    assert balance_patch._register_balance_scheduling is plugin.register
    balance_patch.check_balance_scheduling()
'''

SRF_COMMIT = Commit(
    slug="Scheduler-Select-ShortRequestFirst-through-scheduler_c",
    message=SRF_MESSAGE,
    edits=(
        Edit(
            SRF_MODULE,
            "from vllm.v1.request import Request, RequestStatus\n\n"
            "if TYPE_CHECKING:\n"
            "    from vllm.v1.core.sched.scheduler import Scheduler\n",
            "from vllm.v1.core.sched.scheduler import Scheduler\n"
            "from vllm.v1.request import Request, RequestStatus\n\n"
            "if TYPE_CHECKING:\n"
            "    from vllm.config import VllmConfig\n",
        ),
        Edit(
            SRF_MODULE,
            "class ShortRequestFirstAsyncScheduler(AsyncScheduler):\n"
            '    """Async scheduler that installs the ShortRequestFirst waiting queue."""\n',
            "class ShortRequestFirstMixin:\n"
            '    """Installs the ShortRequestFirst waiting queue after the scheduler\'s own '
            '__init__."""\n\n'
            "    vllm_config: VllmConfig  # set by the scheduler's own __init__\n",
        ),
        Edit(
            SRF_MODULE,
            "                long_max_wait_ms=short_request_first_config.long_max_wait_ms,\n"
            "            )\n",
            "                long_max_wait_ms=short_request_first_config.long_max_wait_ms,\n"
            "            )\n"
            "\n\n"
            "class ShortRequestFirstScheduler(ShortRequestFirstMixin, Scheduler):\n"
            '    """Synchronous scheduler that installs the ShortRequestFirst waiting queue."""\n'
            "\n\n"
            "class ShortRequestFirstAsyncScheduler(ShortRequestFirstMixin, AsyncScheduler):\n"
            '    """Async scheduler that installs the ShortRequestFirst waiting queue."""\n',
        ),
        Edit(
            PLATFORM,
            '                "vllm_ascend.core.short_request_first_scheduler.'
            'ShortRequestFirstAsyncScheduler"\n'
            "            )\n",
            '                "vllm_ascend.core.short_request_first_scheduler.'
            'ShortRequestFirstAsyncScheduler"\n'
            "            )\n"
            "        else:\n"
            "            vllm_config.scheduler_config.scheduler_cls = (\n"
            f'                "{SRF_CLASS}"\n'
            "            )\n",
        ),
        Edit(
            "tests/ut/test_platform.py",
            "                    self.platform.check_and_update_config(vllm_config)\n\n"
            "                self.assertIsNone(vllm_config.scheduler_config.scheduler_cls)\n",
            "                    self.platform.check_and_update_config(vllm_config)\n\n"
            "                self.assertEqual(\n"
            "                    vllm_config.scheduler_config.scheduler_cls,\n"
            f'                    "{SRF_CLASS}",\n'
            "                )\n",
        ),
        Edit(
            "tests/ut/test_platform.py",
            "        self.assertTrue(ascend_config.scheduler_config.short_request_first_config"
            ".enabled)\n"
            "        self.assertIsNone(vllm_config.scheduler_config.scheduler_cls)\n",
            "        self.assertTrue(ascend_config.scheduler_config.short_request_first_config"
            ".enabled)\n"
            "        self.assertEqual(\n"
            "            vllm_config.scheduler_config.scheduler_cls,\n"
            f'            "{SRF_CLASS}",\n'
            "        )\n",
        ),
        Edit(
            "tests/ut/core/test_short_request_first_scheduler_install.py",
            "from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue\n",
            "from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue\n"
            "from vllm.v1.core.sched.scheduler import Scheduler\n",
        ),
        Edit(
            "tests/ut/core/test_short_request_first_scheduler_install.py",
            "    ShortRequestFirstRequestQueue,\n",
            "    ShortRequestFirstRequestQueue,\n    ShortRequestFirstScheduler,\n",
        ),
        Edit(
            "tests/ut/core/test_short_request_first_scheduler_install.py",
            '@pytest.mark.parametrize("enabled", [False, True])\n'
            "def test_async_scheduler_only_installs_queue_when_enabled(enabled):\n",
            "@pytest.mark.parametrize(\n"
            '    "base, scheduler_cls",\n'
            "    [(AsyncScheduler, ShortRequestFirstAsyncScheduler), (Scheduler, "
            "ShortRequestFirstScheduler)],\n"
            ")\n"
            '@pytest.mark.parametrize("enabled", [False, True])\n'
            "def test_scheduler_only_installs_queue_when_enabled(base, scheduler_cls, enabled):\n",
        ),
        Edit(
            "tests/ut/core/test_short_request_first_scheduler_install.py",
            '        patch.object(AsyncScheduler, "__init__", initialize_async_scheduler),\n',
            '        patch.object(base, "__init__", initialize_async_scheduler),\n',
        ),
        Edit(
            "tests/ut/core/test_short_request_first_scheduler_install.py",
            "        scheduler = ShortRequestFirstAsyncScheduler(vllm_config=vllm_config)\n",
            "        scheduler = scheduler_cls(vllm_config=vllm_config)\n",
        ),
    ),
)

DELEGATE_COMMIT = Commit(
    slug="Scheduler-Delegate-balance-scheduling-to-vllm-balance-",
    message=DELEGATE_MESSAGE,
    edits=(
        Edit(BALANCE_MODULE, "", NEW_BALANCE_MODULE),
        Edit("tests/ut/patch/platform/test_patch_balance_schedule.py", "", NEW_BALANCE_TEST),
        Edit(
            PLATFORM,
            "                \"PD-disaggregated mode (kv_role='kv_producer'/'kv_consumer').\"\n"
            "            )\n",
            "                \"PD-disaggregated mode (kv_role='kv_producer'/'kv_consumer').\"\n"
            "            )\n"
            "        from vllm_ascend.patch.platform.patch_balance_schedule import "
            "check_balance_scheduling\n\n"
            "        check_balance_scheduling()\n",
        ),
        Edit(
            PLATFORM,
            '                "ShortRequestFirst scheduling cannot be enabled with '
            'profiling_chunk_config. "\n'
            '                "Please disable one of them."\n'
            "            )\n",
            '                "ShortRequestFirst scheduling cannot be enabled with '
            'profiling_chunk_config. "\n'
            '                "Please disable one of them."\n'
            "            )\n"
            "        if scheduler_extension_config.enable_balance_scheduling:\n"
            "            raise ValueError(\n"
            '                "ShortRequestFirst scheduling cannot be enabled with '
            'enable_balance_scheduling: "\n'
            '                "both select the scheduler class. Please disable one of them."\n'
            "            )\n",
        ),
        Edit(
            DYNTRA,
            "import vllm_ascend.patch.platform.patch_balance_schedule as _balance_patch\n",
            "",
        ),
        Edit(
            DYNTRA,
            "_UpstreamRunEngineCore = _balance_patch._OriginalRunEngineCore\n",
            "# Balance scheduling swaps no DPEngineCoreProc here any more: what this wraps is "
            "vLLM's\n"
            "# run_engine_core or vllm-balance-scheduling's wrapper, which leaves a "
            "DPEngineCoreProc\n"
            "# it did not install alone (and DyntraLB excludes balance scheduling).\n"
            "_UpstreamRunEngineCore = _PreviousRunEngineCore\n",
        ),
        Edit(
            "tests/ut/patch/platform/test_patch_dyntra_lb_core.py",
            "    assert dyntra_lb_core._UpstreamRunEngineCore is "
            "dyntra_lb_core._balance_patch._OriginalRunEngineCore\n",
            "    assert dyntra_lb_core._UpstreamRunEngineCore is "
            "dyntra_lb_core._PreviousRunEngineCore\n",
        ),
        Edit(
            "vllm_ascend/patch/__init__.py",
            "#   1. `vllm.v1.engine.core.EngineCoreProc.run_engine_core`\n"
            "#      `vllm.v1.core.sched.scheduler.Scheduler`\n",
            "#   1. `vllm.v1.engine.core.EngineCoreProc.run_engine_core` "
            "(by vllm-balance-scheduling)\n",
        ),
        Edit(
            "vllm_ascend/patch/__init__.py",
            "#       Set --additional-config '{\"enable_balance_scheduling\": true}' or\n"
            "#       set environmental variable VLLM_ASCEND_BALANCE_SCHEDULING=1 (deprecated).\n",
            "#       Delegated to the vllm-balance-scheduling package: importing this file "
            "registers its\n"
            "#       run_engine_core wrapper, which installs its scheduler and DP engine core "
            "only when\n"
            "#       --additional-config "
            '\'{"scheduler_config": {"enable_balance_scheduling": true}}\''
            " is set\n"
            "#       (or VLLM_ASCEND_BALANCE_SCHEDULING=1, deprecated). No vLLM name is "
            "swapped here.\n",
        ),
        Edit(
            "tests/ut/core/test_profiling_chunk.py",
            '    @patch("vllm_ascend.patch.platform.patch_balance_schedule.init_ascend_config")\n',
            "",
        ),
        Edit(
            "tests/ut/core/test_profiling_chunk.py",
            "    def create_scheduler(self, mock_get_ascend_config, mock_init_ascend_config):\n",
            "    def create_scheduler(self, mock_get_ascend_config):\n",
        ),
        Edit(
            "tests/ut/core/test_profiling_chunk.py",
            "        mock_init_ascend_config.return_value.scheduler_config"
            ".short_request_first_config.enabled = False\n",
            "",
        ),
        Edit(
            "vllm_ascend/observability/config/base_metrics.yaml",
            "- symbol: vllm_ascend.patch.platform.patch_balance_schedule:"
            "BalanceScheduler.schedule\n"
            "  handler: ms_service_metric.provider_handlers:scheduler_scheduler_hooker\n\n",
            "",
        ),
        Edit(
            "tests/ut/observability/test_ms_metrics_provider.py",
            "    assert len(config) == 12\n",
            "    assert len(config) == 11\n",
        ),
        Edit(
            "mypy.ini",
            "[mypy-vllm.v1.kv_offload.*]\nignore_missing_imports = True\n",
            "[mypy-vllm.v1.kv_offload.*]\nignore_missing_imports = True\n\n"
            "; Optional: balance scheduling is delegated to it (patch_balance_schedule.py).\n"
            "[mypy-vllm_balance.*]\nignore_missing_imports = True\n",
        ),
        Edit(
            "docs/source/user_guide/configuration/additional_config.md",
            "| `enable_balance_scheduling` | bool | `False` | "
            "Whether to enable balance scheduling.",
            "| `enable_balance_scheduling` | bool | `False` | Whether to enable balance scheduling "
            "(needs `pip install vllm-balance-scheduling`; not with `short_request_first_config`).",
        ),
    ),
)

SERIES = (SRF_COMMIT, DELEGATE_COMMIT)
TOUCHED = sorted({edit.path for commit in SERIES for edit in commit.edits})


def git(*args: str, cwd: Path, stdin: bytes | None = None) -> bytes:
    return subprocess.run(
        ["git", *args], cwd=cwd, input=stdin, check=True, capture_output=True
    ).stdout


def apply_edit(root: Path, edit: Edit) -> None:
    path = root / edit.path
    if not edit.old:
        path.write_text(edit.new)
        return
    text = path.read_text()
    count = text.count(edit.old)
    if count != 1:
        raise SystemExit(f"{edit.path}: the text to replace occurs {count} times:\n{edit.old}")
    path.write_text(text.replace(edit.old, edit.new))


def check_rewrites(text: str, whole_files: list[Edit]) -> None:
    """Every whole-file edit is written as a rewrite (new text only) that gives back its text."""
    rewrites = {r.path: r.text for r in split_rewrites(text)[0]}
    for edit in whole_files:
        if rewrites.get(edit.path) != edit.new:
            raise SystemExit(f"{edit.path}: not written as a whole-file rewrite (git diff -B -D)")


def generate(source: str, out: Path) -> list[Path]:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        archive = git(f"--git-dir={source}", "archive", BASE_COMMIT, "--", *TOUCHED, cwd=root)
        tarfile.open(fileobj=io.BytesIO(archive)).extractall(root, filter="data")
        identity = ["-c", "user.name=make_series", "-c", "user.email=make_series@localhost"]
        git("init", "-q", cwd=root)
        git("add", "-A", cwd=root)
        git(*identity, "commit", "-qm", "base", cwd=root)
        out.mkdir(parents=True, exist_ok=True)
        for old in patches(out):
            old.unlink()
        written = []
        for number, commit in enumerate(SERIES, 1):
            for edit in commit.edits:
                apply_edit(root, edit)
            git("add", "-A", cwd=root)
            stat = git("diff", "--cached", "--stat=80", cwd=root).decode()
            diff = git("diff", "--cached", "-B", "-D", "--full-index", "--no-color", cwd=root)
            text = render(commit.message, stat, diff.decode())
            check_rewrites(text, [e for e in commit.edits if not e.old])
            path = out / f"{number:04d}-{commit.slug}.patch"
            path.write_text(text)
            written.append(path)
            git(*identity, "commit", "-qm", commit.slug, cwd=root)
        return written


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="a vllm-ascend git dir with BASE_COMMIT")
    parser.add_argument("--check", action="store_true", help="compare with the committed series")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if not args.check:
        for path in generate(args.source, SERIES_DIR):
            print(path.relative_to(SERIES_DIR.parent.parent.parent))
        return
    with tempfile.TemporaryDirectory() as scratch:
        fresh = generate(args.source, Path(scratch))
        stale = [p.name for p in fresh if (SERIES_DIR / p.name).read_bytes() != p.read_bytes()]
        names = [p.name for p in fresh] != [p.name for p in patches()]
    if stale or names:
        raise SystemExit(f"upstream_patch/vllm-ascend series differs from a regeneration: {stale}")
    print(f"series matches a regeneration from vllm-ascend {BASE_COMMIT}")


if __name__ == "__main__":
    main()
