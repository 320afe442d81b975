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

That is vLLM up to 0.26. From 0.27.0 the balancer keeps the client's exact count of its own
unfinished requests per rank as a floor under the snapshot (``inflight-floor``, below): a burst
between snapshots then spreads over the ranks instead of piling onto the one the snapshot shows
least loaded (measured against a real vLLM 0.30 server: docs/results.md, "Emulated device,
DP=4/8").
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


class InflightFloorRouter(LeastLoadedRouter):
    """vLLM 0.27+'s DP load balancer (``DPLBAsyncMPClient.get_core_engine_for_request``).

    Score per rank: ``max(client_count * inflight, waiting + running)``, lowest wins; ``inflight``
    is the client's exact count of its requests routed to the rank and not finished (one client
    here, and the simulator delivers a request the moment it is routed, so it is the rank's live
    waiting + running), ``waiting + running`` the coordinator's snapshot (every 100 ms) with the
    client's bump, as in ``stale+bump``. The scan starts one rank later after every request, so
    equal scores rotate instead of favouring rank 0. Left out: the KV-pressure term
    (``waiting * 6 * max(0, kv_usage - 0.5)``), 0 while the KV cache is at most half full.
    """

    name = "inflight-floor"

    def __init__(self, dp_size: int, snapshot_interval_s: float = 0.1) -> None:
        super().__init__(dp_size, "stale+bump", snapshot_interval_s)
        self._start = 0

    def route(self, current_counts: Callable[[], Counts]) -> int:
        live = current_counts()
        best, rank = None, 0
        for i in range(self.dp_size):
            index = (self._start + i) % self.dp_size
            snapshot_waiting, snapshot_running = self._snapshot[index]
            score = max(sum(live[index]), snapshot_waiting + snapshot_running)
            if best is None or score < best:
                best, rank = score, index
        self._snapshot[rank][0] += 1
        self._start = (self._start + 1) % self.dp_size
        return rank


ROUTERS = ("least-loaded", "inflight-floor", "round-robin")


def make_router(
    name: str, dp_size: int, staleness: str, snapshot_interval_s: float
) -> RoundRobinRouter | LeastLoadedRouter:
    """``staleness`` is what ``least-loaded`` sees; ``inflight-floor`` has its own view."""
    if name == "round-robin":
        return RoundRobinRouter(dp_size)
    if name == "least-loaded":
        return LeastLoadedRouter(dp_size, staleness, snapshot_interval_s)
    if name == "inflight-floor":
        return InflightFloorRouter(dp_size, snapshot_interval_s)
    raise ValueError(f"router {name!r}: expected one of {', '.join(ROUTERS)}")
