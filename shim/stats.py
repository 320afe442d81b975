"""Counters of what balance scheduling did on one DP rank, and the periodic log line.

The counters are updated where the data already is (the gathered vector after the gather, the
gate decision once per ``schedule()``): no extra collective and no per-iteration cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_balance.config import DEFAULT_LOG_INTERVAL_S
from vllm_balance.log import logger

if TYPE_CHECKING:
    from vllm_balance.shim.metrics import BalanceMetrics


@dataclass
class BalanceStats:
    """Cumulative counters for one rank (read by the simulator and tests; logged periodically)."""

    # schedule() calls with balance enabled, and those whose WAITING admission was frozen.
    steps: int = 0
    frozen_steps: int = 0
    # Frozen steps opened by the opt-in bounded hold (balance_max_frozen_steps).
    released_steps: int = 0
    # WAITING requests held back: the waiting-queue length on each frozen step, summed.
    deferred_admissions: int = 0
    gathers: int = 0
    # Seconds spent in those gathers, waiting for the slowest rank included.
    gather_seconds: float = 0.0
    # Last gathered vector's max / min / mean running, and the largest max - min ever gathered.
    gathered_max: int = 0
    gathered_min: int = 0
    gathered_mean: float = 0.0
    largest_gap: int = 0
    # The last gathered vector itself, one count per DP rank (the gather watchdog names them);
    # empty under balance_collective=recursive_doubling, which reduces instead of gathering.
    last_gathered: list[int] = field(default_factory=list)
    # Gathers the watchdog reported (waited longer than balance_gather_warn_s), and the longest
    # wait it saw (a gather still in flight counts with its wait so far).
    blocked_gathers: int = 0
    longest_gather_wait_s: float = 0.0
    _last_frozen: bool = field(default=False, repr=False)

    @property
    def frozen_fraction(self) -> float:
        return self.frozen_steps / self.steps if self.steps else 0.0

    def record_gather(self, counts: list[int]) -> None:
        self.gathers += 1
        self.last_gathered = counts
        self.gathered_max, self.gathered_min = max(counts), min(counts)
        self.gathered_mean = sum(counts) / len(counts)
        self.largest_gap = max(self.largest_gap, self.gathered_max - self.gathered_min)

    def record_reduced(self, maximum: int, minimum: int, total: int, dp_size: int) -> None:
        """``record_gather`` from the log-depth reduction's max, min and sum (no per-rank list)."""
        self.gathers += 1
        self.last_gathered = []
        self.gathered_max, self.gathered_min = maximum, minimum
        self.gathered_mean = total / dp_size
        self.largest_gap = max(self.largest_gap, maximum - minimum)

    def record_step(self, frozen: bool, released: bool, num_waiting: int, dp_rank: int) -> None:
        self.steps += 1
        self.released_steps += released
        if frozen:
            self.frozen_steps += 1
            self.deferred_admissions += num_waiting
        if frozen != self._last_frozen:
            logger.debug("balance DP%d: admission %s", dp_rank, "frozen" if frozen else "open")
            self._last_frozen = frozen

    def log_line(self, dp_rank: int) -> str:
        return (
            f"Balance DP{dp_rank}: steps={self.steps}, frozen={100 * self.frozen_fraction:.1f}%, "
            f"deferred admissions={self.deferred_admissions}, released={self.released_steps}, "
            f"gathered running max/min/mean={self.gathered_max}/{self.gathered_min}/"
            f"{self.gathered_mean:.1f}, largest gap={self.largest_gap}, "
            f"gather blocked={self.blocked_gathers} (longest {self.longest_gather_wait_s:.1f} s)"
        )


class PeriodicLog:
    """Every ``interval_s`` seconds: logs ``stats.log_line()`` and publishes to ``metrics``.

    ``interval_s=None`` turns the line off; the metrics are then published every
    ``DEFAULT_LOG_INTERVAL_S``. Publishing with the line keeps /metrics equal to it: the
    counters published here reach the API server with this step's ``SchedulerStats``
    (``vllm_balance.shim.metrics``).
    """

    def __init__(self, interval_s: float | None, metrics: BalanceMetrics | None = None) -> None:
        self.log = interval_s is not None
        self.metrics = metrics
        self.interval_s = interval_s or (DEFAULT_LOG_INTERVAL_S if metrics else None)
        self._next = time.monotonic() + self.interval_s if self.interval_s else 0.0

    def maybe_log(self, stats: BalanceStats, dp_rank: int) -> None:
        if not self.interval_s:
            return
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval_s
            if self.log:
                logger.info("%s", stats.log_line(dp_rank))
            if self.metrics is not None:
                self.metrics.publish(stats)
