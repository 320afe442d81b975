"""Phase 2A derivation (vllm_balance.compat.derive): drift, fail-closed anchors, fingerprints.

The drift tests are never skipped: they are what turns a pin advance red until the new ref is
verified (the old patch's drift test was skipped in CI because vLLM was not a git checkout).
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import linecache
import logging
import os
import re
import textwrap
import traceback
from pathlib import Path

import pytest
import vllm
import vllm.v1.core.sched.scheduler as scheduler_module
from conftest import no_derived_copy_reason
from vllm.v1.core.sched.scheduler import Scheduler

from balance_testbed.pins import read_pin
from vllm_balance.selection import has_seam

if has_seam():
    # The seam sessions run the shim; compat is never selected there (and would rightly
    # refuse the seamed schedule() as unverified). Its drift test runs in the compat sessions.
    pytest.skip("vLLM has the seam: the compat path is not used", allow_module_level=True)
if reason := no_derived_copy_reason():
    pytest.skip(reason, allow_module_level=True)

from balance_testbed.factories import add_requests, make_requests, make_scheduler
from vllm_balance.compat import derive
from vllm_balance.compat.derive import (
    ALLOW_UNVERIFIED_ENV,
    DELTA_DISABLED_PATH,
    DELTA_GATE,
    DELTA_GATE_FRESH,
    DELTA_NO_QUEUE,
    QUEUE_ASSERT,
    QUEUE_SELECTION,
    WAITING_LOOP,
    Phase2AUnavailable,
    UnverifiedSchedule,
    normalized_dump,
)
from vllm_balance.log import LOGGER_NAME
from vllm_balance.slot_check import is_slot_check

ROOT = Path(__file__).resolve().parent.parent


def compat_module():
    # Imported per test: on an unverified vLLM the import raises, and the drift test below must
    # still run and fail with its own message (not a collection error hiding it).
    import vllm_balance.compat.scheduler as compat_scheduler

    return compat_scheduler


def upstream_schedule_ast() -> ast.FunctionDef:
    return derive.find_schedule(ast.parse(inspect.getsource(scheduler_module)), "installed")


def installed_derivation() -> derive.DerivedSource:
    return derive.derive_source(inspect.getsource(scheduler_module), "x")


def upstream_asserts_a_queue() -> bool:
    """Whether the installed schedule() has the assert delta 3 replaces (0.24-0.30 do)."""
    return installed_derivation().replaces_queue_assert


needs_queue_assert = pytest.mark.skipif(
    not upstream_asserts_a_queue(),
    reason="this vLLM's WAITING loop has no queue assert: delta 3 does not apply",
)


def expected_counts(queue_assert: bool = True) -> dict[str, int]:
    """What strip_deltas counts in a derived schedule()."""
    return {"disabled path": 1, "gate": 1, "no queue": int(queue_assert)}


def installed_counts() -> dict[str, int]:
    return expected_counts(installed_derivation().replaces_queue_assert)


def generated_source() -> str:
    filename = compat_module().Phase2ASchedule.schedule.__code__.co_filename
    return "".join(linecache.getlines(filename))


def generated_schedule_ast(source: str | None = None) -> ast.FunctionDef:
    tree = ast.parse(source or generated_source())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    (fn,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "schedule"]
    return fn


def delta_dump(block: tuple[str, ...]) -> str:
    return normalized_dump(ast.parse("\n".join(block)).body[0])


def strip_deltas(
    fn: ast.FunctionDef, docstring: bool = False
) -> tuple[ast.FunctionDef, dict[str, int]]:
    """Undo the deltas on a copy; count each, and check where it sits."""
    fn = copy.deepcopy(fn)
    disabled, no_queue = map(delta_dump, (DELTA_DISABLED_PATH, DELTA_NO_QUEUE))
    gates = {delta_dump(DELTA_GATE), delta_dump(DELTA_GATE_FRESH)}
    selection = normalized_dump(ast.parse(QUEUE_SELECTION).body[0])
    counts = dict.fromkeys(expected_counts(), 0)
    for node in ast.walk(fn):
        stmts = getattr(node, "body", None)
        if not isinstance(stmts, list):
            continue
        kept: list[ast.stmt] = []
        for i, stmt in enumerate(stmts):
            dump = normalized_dump(stmt)
            if dump == disabled:
                assert node is fn and i == int(docstring), "delta 1 must come first"
                counts["disabled path"] += 1
            elif dump in gates:
                assert isinstance(node, ast.While) and is_slot_check(stmts[i - 1]), (
                    "delta 2 comes right after upstream's slot check"
                )
                counts["gate"] += 1
            elif dump == no_queue:
                assert normalized_dump(stmts[i - 1]) == selection, "delta 3 follows the selection"
                counts["no queue"] += 1
                kept.append(ast.parse(QUEUE_ASSERT).body[0])
            else:
                kept.append(stmt)
        stmts[:] = kept
    return fn, counts


# --- drift (never skipped) -------------------------------------------------------------------


def test_drift_generated_schedule_is_upstream_plus_exactly_its_deltas():
    stripped, counts = strip_deltas(generated_schedule_ast())
    assert counts == installed_counts()
    assert normalized_dump(stripped) == normalized_dump(upstream_schedule_ast())


def test_drift_comparison_catches_one_more_change():
    # Negative control for the drift test itself: one extra statement must break equality.
    source = generated_source()
    body_indent = generated_schedule_ast(source).body[0].col_offset
    mutated = source + " " * body_indent + "pass\n"
    stripped, counts = strip_deltas(generated_schedule_ast(mutated))
    assert counts == installed_counts()
    assert normalized_dump(stripped) != normalized_dump(upstream_schedule_ast())


def test_derived_schedule_is_the_seamed_schedule_with_the_gate_inlined():
    """Compat gives exactly the shim's behaviour: the derived schedule() is the seam series'
    schedule() for this release (upstream_patch/) with the seam's call read as the gate (the
    shim's override: ``balance_gate.frozen``, recorded in ``balance_gate.deferred``), less delta 1
    (balance off runs upstream's own) and delta 3 (an assert that real state never trips)."""
    from balance_testbed.seam_patch import SEAM_METHOD, match_series, scheduler_text

    source = inspect.getsource(scheduler_module)
    seamed = scheduler_text(source, match_series(source, vllm.__version__).series)
    expected = normalized_dump(derive.find_schedule(ast.parse(seamed), "seamed"))
    derived = generated_source().replace("self.balance_gate.frozen", f"self.{SEAM_METHOD}()")
    assert derived.count("self.balance_gate.deferred = True") == 1
    derived = re.sub(r"\n *self\.balance_gate\.deferred = True", "", derived)
    fn = generated_schedule_ast(derived)
    disabled, no_queue = delta_dump(DELTA_DISABLED_PATH), delta_dump(DELTA_NO_QUEUE)
    for node in ast.walk(fn):
        stmts = getattr(node, "body", None)
        if isinstance(stmts, list):
            stmts[:] = [
                ast.parse(QUEUE_ASSERT).body[0] if normalized_dump(s) == no_queue else s
                for s in stmts
                if normalized_dump(s) != disabled
            ]
    assert normalized_dump(fn) == expected


def test_drift_upstream_compared_is_the_schedule_that_runs():
    # The AST we derive from must be the function vLLM's Scheduler actually has.
    code = Scheduler.schedule.__code__
    assert code.co_filename == inspect.getsourcefile(scheduler_module)
    assert code.co_firstlineno == upstream_schedule_ast().lineno  # (it has no decorators)


def test_drift_pinned_ref_fingerprint_is_verified():
    pin_name = os.environ.get("VLLM_BALANCE_PIN")
    if pin_name:
        pin = read_pin(pin_name)
        if pin.version is not None:  # URL/commit pins carry no version to compare
            assert vllm.__version__ == pin.version, f"{pin.label} but vLLM {vllm.__version__}"
    installed = derive.fingerprint(upstream_schedule_ast())
    assert installed in derive.verified_fingerprints(), (
        f"vLLM {vllm.__version__} schedule() fingerprint {installed} is not verified; verify the "
        "new ref, then add it to compat/fingerprints.json"
    )


# --- fingerprints ------------------------------------------------------------------------------


def test_fingerprint_ignores_formatting_and_comments_but_not_code():
    source = inspect.getsource(scheduler_module)
    original = derive.fingerprint(upstream_schedule_ast())
    # Any one-line assignment of schedule() will do; the WAITING loop has one in every release.
    loop = derive.waiting_loop(upstream_schedule_ast(), "installed")
    assignment = next(
        s for s in loop.body if isinstance(s, ast.Assign) and s.end_lineno == s.lineno
    )
    selection_line = source.splitlines()[assignment.lineno - 1]
    indent = selection_line[: len(selection_line) - len(selection_line.lstrip())]
    reformatted = source.replace(
        selection_line + "\n", f"{indent}# a comment\n\n{selection_line}  # another\n", 1
    )
    changed = source.replace(selection_line + "\n", f"{selection_line}\n{indent}pass\n", 1)
    assert derive.fingerprint(derive.find_schedule(ast.parse(reformatted), "x")) == original
    assert derive.fingerprint(derive.find_schedule(ast.parse(changed), "x")) != original


def test_unverified_fingerprint_is_refused_in_one_line_naming_nearest_and_reach(
    monkeypatch, tmp_path
):
    refs = [
        {"release": r, "fingerprint": f"sha256:{i}", "date": "2026-11-30", "evidence": "run"}
        for i, r in enumerate(["0.24.0", "0.27.1", "0.30.0"])
    ]
    verified = tmp_path / "fingerprints.json"
    verified.write_text(json.dumps({"verified": refs}))
    monkeypatch.setattr(derive, "FINGERPRINTS_FILE", verified)
    # `nox -s reach` runs this suite with the override set (it is verifying the release).
    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    unknown = "sha256:" + "0" * 64
    with pytest.raises(UnverifiedSchedule) as excinfo:
        derive.check_verified(unknown, "0.28.0")
    message = str(excinfo.value)
    assert unknown in message and "0.28.0" in message and ALLOW_UNVERIFIED_ENV in message
    assert "upstream_patch/" in message and "\n" not in message
    assert "nearest: 0.27.1, 0.30.0" in message
    assert "`nox -s reach -- --versions 0.28.0`" in message


@pytest.mark.parametrize(
    ("installed", "nearest"),
    [("0.28.0", "0.27.1, 0.30.0"), ("0.30.0+cpu", "0.30.0"), ("0.20.0", "0.24.0"), ("x", "all")],
)
def test_nearest_verified_releases(monkeypatch, tmp_path, installed, nearest):
    refs = [
        {"release": r, "fingerprint": r, "date": "2026-11-30", "evidence": "run"}
        for r in ["0.30.0", "0.24.0", "0.27.1"]
    ]
    verified = tmp_path / "fingerprints.json"
    verified.write_text(json.dumps({"verified": refs}))
    monkeypatch.setattr(derive, "FINGERPRINTS_FILE", verified)
    expected = "0.24.0, 0.27.1, 0.30.0" if nearest == "all" else nearest
    assert derive.nearest_verified(installed) == expected


def test_every_verified_entry_has_release_fingerprint_date_and_evidence():
    for ref in derive.verified_refs():
        assert ref.release and ref.fingerprint.startswith("sha256:") and ref.evidence
        assert len(ref.date) == 10 and ref.date[4] == ref.date[7] == "-"


@pytest.mark.parametrize("value", ["0", "true", ""])
def test_override_must_be_exactly_1(monkeypatch, value):
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, value)
    with pytest.raises(UnverifiedSchedule):
        derive.check_verified("sha256:" + "0" * 64, "9.9.9")


def test_override_allows_unverified_schedule_with_a_warning(monkeypatch, caplog, tmp_path):
    # End to end on the real installed source: an empty verified set refuses it...
    empty = tmp_path / "fingerprints.json"
    empty.write_text(json.dumps({"verified": []}))
    monkeypatch.setattr(derive, "FINGERPRINTS_FILE", empty)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    with pytest.raises(UnverifiedSchedule):
        derive.build_phase2a_schedule()
    # ...and the operator's override lets it through, naming the fingerprint.
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        cls = derive.build_phase2a_schedule()
    assert issubclass(cls, Scheduler)
    installed = derive.fingerprint(upstream_schedule_ast())
    assert any(installed in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


# --- anchors fail closed -----------------------------------------------------------------------

PAIR = f"{QUEUE_SELECTION}\n{QUEUE_ASSERT}\n"
# Our own text in the shape of the anchors: a loop that stops on a request-slot limit.
LOOP_HEADER = "while self.queue and budget > 0:"
SLOT_CHECK = "if len(self.running) >= self.max_num_admitted_reqs:\n    break\n"
# Upstream text after the loop that no delta touches (vLLM's prefill cadence has one like it).
CAPACITY = "if not deferred:\n    self.prefill_capacity_bound = bool(self.queue)\n"


def synthetic(
    loop_body: str = PAIR,
    *,
    header: str = "schedule(self, throttle_prefills=False)",
    loops: int = 1,
    after_loop: str = CAPACITY,
    slot_check: str = SLOT_CHECK,
) -> str:
    """A tiny module shaped like vLLM's anchors (our own text, built from derive's constants)."""
    loop = f"{LOOP_HEADER}\n" + textwrap.indent("x = 2\n" + slot_check + loop_body, "    ")
    body = "x = 1\n" + loop * loops + after_loop
    return f"class Scheduler:\n    def {header}:\n" + textwrap.indent(body, " " * 8)


@pytest.mark.parametrize("docstring", [False, True])
def test_synthetic_source_with_all_anchors_derives(docstring):
    # Positive control for the negative controls below; delta 1 goes after a docstring.
    source = synthetic()
    if docstring:
        source = source.replace("        x = 1\n", '        """Doc."""\n        x = 1\n', 1)
    derived = derive.derive_source(source, "9.9.9")
    stripped, counts = strip_deltas(generated_schedule_ast(derived.source), docstring)
    assert counts == expected_counts()
    assert normalized_dump(stripped) == normalized_dump(derived.upstream)
    assert "plus three deltas" in derived.source


def test_loop_without_queue_selection_and_assert_gets_no_delta_3():
    # 0.31+'s shape: the loop picks its queue and breaks on an empty one itself.
    derived = derive.derive_source(synthetic("q = self.queue\n"), "9.9.9")
    assert not derived.replaces_queue_assert and "delta 3 not applicable" in derived.source
    stripped, counts = strip_deltas(generated_schedule_ast(derived.source))
    assert counts == expected_counts(queue_assert=False)
    assert normalized_dump(stripped) == normalized_dump(derived.upstream)


@pytest.mark.parametrize(
    ("slot_check", "gate"),
    [
        (SLOT_CHECK, DELTA_GATE),
        ("request_queue = self.kv_holding_waiting or self.queue\n" + SLOT_CHECK, DELTA_GATE_FRESH),
        ("request_queue = self.queue\n" + SLOT_CHECK, DELTA_GATE),
    ],
    ids=["one-queue", "kv-holders-first", "queue-picked-without-kv-holders"],
)
def test_gate_takes_the_seam_form_of_the_loop(slot_check, gate):
    """Where the loop drains the requests that hold KV blocks first (0.31+), the gate holds
    fresh requests only, as the seam does; elsewhere it ends the loop."""
    derived = derive.derive_source(synthetic("q = 1\n", slot_check=slot_check), "9.9.9")
    lines = "\n".join(line.strip() for line in derived.source.splitlines())
    assert lines.count("\n".join(line.strip() for line in gate)) == 1
    assert derived.holds_fresh_only is (gate is DELTA_GATE_FRESH)
    stripped, counts = strip_deltas(generated_schedule_ast(derived.source))
    assert counts == expected_counts(queue_assert=False)
    assert normalized_dump(stripped) == normalized_dump(derived.upstream)


@pytest.mark.parametrize(
    "slot_check",
    [
        "if len(self.running) == self.max_num_running_reqs:\n    break\n",
        "n = len(self.running) + 1\nif n >= self.max_num_active_reqs:\n    break\n",
    ],
    ids=["0.24-shape", "0.31-shape"],
)
def test_waiting_loop_is_found_by_its_slot_check_whatever_its_header(slot_check):
    derived = derive.derive_source(synthetic(slot_check=slot_check), "9.9.9")
    assert DELTA_GATE[0] in derived.source


@pytest.mark.parametrize(
    ("source", "anchor", "problem"),
    [
        (synthetic(slot_check="if stop:\n    break\n"), WAITING_LOOP, "is missing"),
        (synthetic(slot_check="if self.max_num_x_reqs:\n    y = 1\n"), WAITING_LOOP, "missing"),
        (synthetic(loops=2), WAITING_LOOP, "matches 2 times"),
        (synthetic(QUEUE_SELECTION + "\n"), QUEUE_ASSERT, "is missing"),
        (synthetic(QUEUE_ASSERT + "\n"), QUEUE_ASSERT, "is missing"),
        (synthetic(PAIR * 2), QUEUE_ASSERT, "matches 2 times"),
        (synthetic("pass\n", after_loop=PAIR), QUEUE_ASSERT, "not directly in the WAITING loop"),
        (
            synthetic().replace(QUEUE_ASSERT, QUEUE_ASSERT + "; z = 1"),
            QUEUE_ASSERT,
            "shares a line",
        ),
        (synthetic(header="schedule(self)"), "schedule(self, throttle_prefills)", "is schedule("),
        (synthetic().replace("def schedule", "def other"), "Scheduler.schedule", "is missing"),
    ],
    ids=[
        "loop-missing",
        "loop-stop-without-break",
        "loop-twice",
        "assert-missing",
        "selection-missing",
        "assert-twice",
        "assert-outside-loop",
        "assert-not-alone",
        "signature",
        "method-missing",
    ],
)
def test_anchor_missing_or_ambiguous_raises_one_clear_error(source, anchor, problem):
    with pytest.raises(Phase2AUnavailable) as excinfo:
        derive.derive_source(source, "9.9.9")
    message = str(excinfo.value)
    assert anchor in message and problem in message
    assert "vLLM 9.9.9" in message and "upstream_patch/" in message
    assert derive.nearest_verified("9.9.9") in message and "nox -s reach" in message


def _real_source_with_extra_lines_after_assert(*extra: str) -> str:
    source = inspect.getsource(scheduler_module)
    assert_line = next(ln for ln in source.splitlines() if ln.strip() == QUEUE_ASSERT)
    indent = assert_line[: len(assert_line) - len(assert_line.lstrip())]
    added = "".join(f"{indent}{line}\n" for line in extra)
    return source.replace(assert_line + "\n", assert_line + "\n" + added, 1)


@needs_queue_assert
def test_real_source_with_changed_assert_raises():
    source = inspect.getsource(scheduler_module).replace(QUEUE_ASSERT, QUEUE_ASSERT + ", 'x'", 1)
    with pytest.raises(Phase2AUnavailable, match="is missing"):
        derive.derive_source(source, vllm.__version__)


@needs_queue_assert
def test_real_source_with_duplicated_anchor_raises():
    source = _real_source_with_extra_lines_after_assert(QUEUE_SELECTION, QUEUE_ASSERT)
    with pytest.raises(Phase2AUnavailable, match="matches 2 times") as excinfo:
        derive.derive_source(source, vllm.__version__)
    assert vllm.__version__ in str(excinfo.value)


# --- readable generated code -------------------------------------------------------------------


def test_generated_schedule_has_source_and_names_each_delta():
    Phase2ASchedule = compat_module().Phase2ASchedule
    source = inspect.getsource(Phase2ASchedule.schedule)
    assert source.count(DELTA_DISABLED_PATH[0]) == source.count(DELTA_GATE[0]) == 1
    assert source.count(DELTA_NO_QUEUE[0]) == installed_counts()["no queue"]
    # CompatBalanceScheduler.schedule is the mixin's, which reaches the generated one via super().
    CompatBalanceScheduler = compat_module().CompatBalanceScheduler
    mro = CompatBalanceScheduler.__mro__
    assert mro.index(Phase2ASchedule) < mro.index(Scheduler)
    mixin_source = inspect.getsource(CompatBalanceScheduler.schedule)
    assert "super().schedule(throttle_prefills)" in mixin_source


def test_generated_code_runs_with_vllm_globals_and_leaves_vllm_module_untouched():
    Phase2ASchedule = compat_module().Phase2ASchedule
    assert Phase2ASchedule.schedule.__globals__ is vars(scheduler_module)
    assert not hasattr(scheduler_module, Phase2ASchedule.__name__)


def test_traceback_from_generated_schedule_shows_generated_file(monkeypatch):
    compat = compat_module()
    scheduler = make_scheduler(
        compat.CompatBalanceScheduler,
        data_parallel_size=2,
        additional_config={"enable_balance_scheduling": True},
    )
    add_requests(scheduler, make_requests(1))

    def boom(*args, **kwargs):
        raise LookupError("raised inside the generated schedule()")

    # Admitting a WAITING request asks the KV cache manager for its cached prefix (every release).
    monkeypatch.setattr(scheduler.kv_cache_manager, "get_computed_blocks", boom)
    with pytest.raises(LookupError) as excinfo:
        scheduler.schedule()
    filename = compat.Phase2ASchedule.schedule.__code__.co_filename
    frames = [f for f in traceback.extract_tb(excinfo.value.__traceback__) if f.name == "schedule"]
    generated = [f for f in frames if f.filename == filename]
    assert len(generated) == 1 and generated[0].line
    assert generated[0].line == linecache.getline(filename, generated[0].lineno).strip()
    assert Path(filename).is_file() and "phase2a_schedule" in Path(filename).name


def test_generated_file_in_cache_dir_matches_compiled_source(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    cls = derive.build_phase2a_schedule()
    filename = Path(cls.schedule.__code__.co_filename)
    assert filename.parent == tmp_path / "vllm_balance" / "compat"
    assert filename.read_text() == "".join(linecache.getlines(str(filename)))


def test_unwritable_cache_dir_still_gives_source_via_linecache(monkeypatch, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(not_a_dir))
    cls = derive.build_phase2a_schedule()
    assert DELTA_GATE[0] in inspect.getsource(cls.schedule)
