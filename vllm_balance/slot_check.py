"""Where upstream's ``Scheduler.schedule()`` stops admitting on the request-slot limit.

The seam's call (and the Phase 2A gate) goes right after that statement, found here by what it
is in every release rather than by its text: an ``if <test reading self.max_num_*_reqs>: break``
directly in a ``while`` loop's body (``max_num_running_reqs`` up to 0.30, ``max_num_active_reqs``
from 0.31; the RUNNING loop preempts instead of breaking). The seam series
(``upstream_patch/make_series.py``) and the Phase 2A derivation (``vllm_balance.compat.derive``)
both use it and its form (``holds_fresh_requests_only``), so they cannot disagree on either.
"""

from __future__ import annotations

import ast
import re

SLOT_LIMIT = re.compile(r"max_num_\w+_reqs")


def is_slot_check(stmt: ast.stmt) -> bool:
    """``if <test reading self.max_num_*_reqs>: break``: the stop on the request-slot limit."""
    return (
        isinstance(stmt, ast.If)
        and not stmt.orelse
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], ast.Break)
        and any(
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and SLOT_LIMIT.fullmatch(node.attr) is not None
            for node in ast.walk(stmt.test)
        )
    )


def slot_checks(schedule: ast.FunctionDef) -> list[tuple[ast.While, ast.If]]:
    """(loop, check) for every slot check directly in a ``while`` body of ``schedule``.

    Every release so far has exactly one, in the WAITING loop; two would be ambiguous, and each
    caller refuses anything but one.
    """
    return [
        (loop, stmt)
        for loop in ast.walk(schedule)
        if isinstance(loop, ast.While)
        for stmt in loop.body
        if isinstance(stmt, ast.If) and is_slot_check(stmt)
    ]


KV_HOLDING_QUEUE = "kv_holding_waiting"  # 0.31+: the waiting requests that hold KV blocks


def holds_fresh_requests_only(loop: ast.While, check: ast.If) -> bool:
    """Whether a hold stops fresh requests only in this WAITING loop: the loop picks
    ``request_queue`` before its slot check and reads ``self.kv_holding_waiting`` there, draining
    the requests that hold KV blocks first (0.31+), so the hold can guard
    ``request_queue is self.waiting``. Before 0.31 the loop takes its request after the check
    from one mixed queue, and a hold ends the loop."""
    before = loop.body[: loop.body.index(check)]
    nodes = [node for stmt in before for node in ast.walk(stmt)]
    picks_queue = any(
        isinstance(n, ast.Name) and n.id == "request_queue" and isinstance(n.ctx, ast.Store)
        for n in nodes
    )
    reads_kv_holders = any(
        isinstance(n, ast.Attribute) and n.attr == KV_HOLDING_QUEUE for n in nodes
    )
    return picks_queue and reads_kv_holders
