"""Markdown tables, as the simulator, tools and benchmarks write them into docs/ and their reports
(tabulate is not a vLLM dependency, and one small function is all they need)."""

from __future__ import annotations

from collections.abc import Iterable


def markdown_table(
    header: str, rows: Iterable, row: str | None = None, *, spaced_rule: bool = False
) -> list[str]:
    """A Markdown table's lines: ``header`` ("a | b"), its rule, one line per entry of ``rows``:
    a dict formatted by the ``str.format`` template ``row``, or (no ``row``) a list of cells.

    The rule is ``|---|---|``, or ``| --- | --- |`` with ``spaced_rule`` (both render alike; a
    generated document keeps the one it has, so that regenerating it changes nothing).
    """
    cells = [row.format(**r) if row else " | ".join(map(str, r)) for r in rows]
    rule = "|" + (" --- |" if spaced_rule else "---|") * (header.count("|") + 1)
    return [f"| {header} |", rule] + [f"| {c} |" for c in cells]
