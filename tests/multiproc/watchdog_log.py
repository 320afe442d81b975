"""The gather watchdog's lines in a rank's log, parsed with the product's own message prefixes."""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_balance.shim.watchdog import BLOCKED, UNBLOCKED

_BLOCKED = re.compile(
    rf"{BLOCKED}: DP(?P<rank>\d+) has waited (?P<seconds>[\d.]+) s in gather #(?P<gather>\d+) "
    rf"of \d+ DP ranks; last gathered running counts(?P<last>[^;]*);"
)
_UNBLOCKED = re.compile(
    rf"{UNBLOCKED}: DP(?P<rank>\d+) gather #(?P<gather>\d+) returned after (?P<seconds>[\d.]+) s"
)


@dataclass(frozen=True)
class WatchdogLine:
    kind: str  # "blocked" or "unblocked"
    rank: int
    gather: int
    seconds: float
    # The last gathered counts as logged: " (gather #9): DP0=4 DP1=4" or ": none yet" ("" on
    # unblocked lines).
    last: str


def watchdog_lines(log: str) -> list[WatchdogLine]:
    """Every watchdog line in ``log``, in order."""
    lines = []
    for text in log.splitlines():
        for kind, pattern in (("blocked", _BLOCKED), ("unblocked", _UNBLOCKED)):
            if match := pattern.search(text):
                fields = match.groupdict()
                lines.append(
                    WatchdogLine(
                        kind,
                        int(fields["rank"]),
                        int(fields["gather"]),
                        float(fields["seconds"]),
                        fields.get("last") or "",
                    )
                )
    return lines


def assert_blocked_exactly(
    watchdog: dict[int, list[WatchdogLine]], in_gather: list[int], warn_s: float
) -> None:
    """Every rank stuck in the gather logged the watchdog error, the others did not.

    ``watchdog`` maps each rank to its watchdog lines, ``in_gather`` names the ranks whose stacks
    show them waiting in ``balance_gather``; the first error comes after ``warn_s`` of waiting.
    """
    for rank, lines in watchdog.items():
        blocked = [line for line in lines if line.kind == "blocked"]
        if rank in in_gather:
            assert blocked and blocked[0].rank == rank, (rank, lines)
            assert blocked[0].seconds >= warn_s, blocked
        else:
            assert blocked == [], (rank, lines)
