"""The repository rules that protect the product: shim/ stands without compat/ (also
tests/test_without_compat.py), the product never imports the simulator, feature detection rather
than version strings, no vLLM source text, support code importing one way (tools/import_pairs.py).
Each test names the rule it keeps."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.path_independent

ROOT = Path(__file__).resolve().parent.parent


def test_shim_never_mentions_compat():
    """shim/ is what stays when compat/ is deleted: nothing in it may know compat exists."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "shim").rglob("*.py")
        if re.search(r"\bcompat\b", path.read_text(), re.IGNORECASE)
    ]
    assert offenders == []


def test_the_product_never_imports_the_simulator():
    """balance_sim/ drives the product's scheduler classes, never the reverse: the product
    (vllm_balance/, shim/, compat/) names no simulator module, by import or by string."""
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("vllm_balance", "shim", "compat")
        for path in (ROOT / folder).rglob("*.py")
        if re.search(r"\bbalance_sim\b", path.read_text())
    ]
    assert offenders == []


def test_vllm_versions_are_written_only_in_pin_files():
    version = re.compile(r"""["'](v?0\.2[4-9]\.\d+|v?0\.3\d\.\d+)["']""")
    offenders = []
    for folder in ("vllm_balance", "shim", "compat", "tools", "testbed"):
        for path in (ROOT / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if version.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_no_vllm_source_text_outside_the_series():
    """Shared runs of >= 6 code lines with the installed vLLM's scheduler.py / core.py, anywhere
    but the seam series and diff blocks in docs."""
    import vllm

    from tools.check_no_vllm_source import shared_runs

    vllm_dir = Path(vllm.__file__).parent
    found = shared_runs(ROOT, vllm_dir)
    if found is None:
        pytest.fail("tools/check_no_vllm_source.py could not read the installed vLLM")
    assert found == []


def test_no_vllm_source_check_finds_pasted_lines_but_not_a_quoted_diff(tmp_path):
    """Negative control for the check above: six of the scheduler's lines pasted into a doc are
    found; the same lines as context in a ```diff block (how the PR description quotes the seam)
    are not."""
    import vllm

    from tools.check_no_vllm_source import code_lines, shared_runs

    vllm_dir = Path(vllm.__file__).parent
    scheduler = vllm_dir / "v1/core/sched/scheduler.py"
    pasted = [text for text, _ in code_lines(scheduler)[200:206]]
    (tmp_path / "pasted.md").write_text("\n".join(["# Notes", *pasted, ""]))
    (tmp_path / "quoted.md").write_text("\n".join(["```diff", *pasted, "```", ""]))

    found = shared_runs(tmp_path, vllm_dir)

    assert [line.split(":")[0] for line in found] == ["pasted.md"]


def test_support_imports_one_way_by_explicit_names():
    """Product <- test bed <- tools, upstream_patch, benchmarks <- tests: no folder pair imports
    both ways, none upward, and no module of another folder by a bare name (it would import only
    with that folder on the path)."""
    from tools.import_pairs import both_ways, crossings, upward

    pairs, bare = crossings()
    assert (both_ways(pairs), upward(pairs), bare) == ([], [], [])


def test_import_pairs_finds_a_bare_name_and_a_pair_both_ways(tmp_path):
    """Negative control for the check above: tools/ importing the test bed is fine; the test bed
    importing a tool by its bare name is all three faults at once."""
    from tools.import_pairs import both_ways, crossings, upward

    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "report.py").write_text("from balance_testbed import pins\n")
    (tmp_path / "testbed" / "balance_testbed").mkdir(parents=True)
    (tmp_path / "testbed" / "balance_testbed" / "pins.py").write_text("import report\n")

    pairs, bare = crossings(tmp_path)

    assert both_ways(pairs) == [("testbed", "tools")]
    assert upward(pairs) == [("testbed", "tools")]
    assert bare == ["testbed/balance_testbed/pins.py: report (tools/)"]
