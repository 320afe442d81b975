"""Routers: which DP rank a new request goes to.

``least-loaded`` is vLLM's DP load balancer (``DPLBAsyncMPClient.get_core_engine_for_request`` in
``vllm/v1/engine/core_client.py``): score ``waiting * 4 + running`` per rank, lowest score wins,
ties to the lowest index (client 0 starts its scan at rank 0). The client does not see the ranks'
live counts: the DP coordinator (``vllm/v1/engine/coordinator.py``,
``min_stats_update_interval_ms=100``) publishes a snapshot about every 100 ms, and between
snapshots the client bumps the chosen rank's waiting count by one (its ``client_count``).
Routing skew from stale counts is where imbalance comes from, so all three views are modelled:

- ``fresh``: the ranks' counts at the moment of routing (an idealised router);
- ``stale``: the last snapshot only (every request until the next snapshot goes to one rank);
- ``stale+bump``: the last snapshot plus the client's optimistic bump (what vLLM does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Counts = Sequence[tuple[int, int]]  # (waiting, running) per rank

STALENESS_MODES = ("fresh", "stale", "stale+bump")


class RoundRobinRouter:
    name = "round-robin"

    def __init__(self, dp_size: int) -> None:
        self.dp_size = dp_size
        self._next = 0

    def publish(self, now_s: float, counts: Counts) -> None:
        """Round-robin ignores load."""

    def route(self, current_counts: Callable[[], Counts]) -> int:
        rank = self._next
        self._next = (self._next + 1) % self.dp_size
        return rank


class LeastLoadedRouter:
    name = "least-loaded"

    def __init__(self, dp_size: int, staleness: str, snapshot_interval_s: float = 0.1) -> None:
        if staleness not in STALENESS_MODES:
            raise ValueError(f"staleness {staleness!r}: expected one of {STALENESS_MODES}")
        self.dp_size = dp_size
        self.staleness = staleness
        self.snapshot_interval_s = snapshot_interval_s
        self._snapshot = [[0, 0] for _ in range(dp_size)]
        self._last_publish_s = float("-inf")

    def publish(self, now_s: float, counts: Counts) -> None:
        """Engines publish after every step; the coordinator forwards at most every interval."""
        if now_s - self._last_publish_s >= self.snapshot_interval_s:
            self._snapshot = [[waiting, running] for waiting, running in counts]
            self._last_publish_s = now_s

    def route(self, current_counts: Callable[[], Counts]) -> int:
        counts = current_counts() if self.staleness == "fresh" else self._snapshot
        rank = min(range(self.dp_size), key=lambda r: (counts[r][0] * 4 + counts[r][1], r))
        if self.staleness == "stale+bump":
            self._snapshot[rank][0] += 1
        return rank


def make_router(
    name: str, dp_size: int, staleness: str, snapshot_interval_s: float
) -> RoundRobinRouter | LeastLoadedRouter:
    if name == "round-robin":
        return RoundRobinRouter(dp_size)
    if name == "least-loaded":
        return LeastLoadedRouter(dp_size, staleness, snapshot_interval_s)
    raise ValueError(f"router {name!r}: expected least-loaded or round-robin")
