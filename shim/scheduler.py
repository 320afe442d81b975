"""BalanceScheduler: vLLM's scheduler plus a global admission gate, on the seam.

The whole feature is two operations:
- ``balance_gather()``: every active engine step, all-gather ``len(self.running)`` across the
  DP group into ``balance_queue`` (triggered by the engine core, never from ``schedule()``;
  see ``vllm_balance.shim.engine_core``);
- the gate: when the largest gathered count **equals** ``max_num_running_reqs``, no rank admits
  WAITING requests this step.

NOTE(contract 1): the comparison is ``==`` against the configured cap: "a leader at the cap
freezes everyone". It is not ``>= cap - 1`` (shipped once in vllm-ascend and reverted for a TTFT
regression on DeepSeek-V3.1 W4A8) and not "let laggards catch up to the leader" (temporarily
lowering the cap to ``max(balance_queue)``), which is a different policy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_balance.config import balance_enabled


class BalanceSchedulerMixin:
    """Balance state and gate; mixed in front of ``Scheduler`` or ``AsyncScheduler``.

    ``balance_queue`` is the public state the gate reads: the engine core's gather writes it,
    and tests and tools may set it directly. The gate value is therefore derived from it when
    ``schedule()`` starts (once per step: it cannot change during one ``schedule()``), not when
    the gather runs, and not once per WAITING-loop iteration.
    """

    # Declared for type checkers: the scheduler attributes the mixin relies on.
    running: list
    max_num_running_reqs: int

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)  # type: ignore[call-arg]
        self._balance_enabled = balance_enabled(vllm_config)
        # Injected by BalanceDPEngineCoreProc: the gloo DP group exists before the scheduler.
        self.dp_group: Any = None
        self.admission_frozen = False
        if self._balance_enabled:
            dp_size = vllm_config.parallel_config.data_parallel_size
            self.balance_queue = [torch.zeros(1, dtype=torch.int32) for _ in range(dp_size)]

    def balance_gather(self) -> None:
        """All-gather ``len(self.running)`` into ``balance_queue``; no-op when disabled/no group."""
        if not self._balance_enabled or self.dp_group is None:
            return
        running_count = torch.tensor([len(self.running)], dtype=torch.int32)
        dist.all_gather(self.balance_queue, running_count, group=self.dp_group)

    def leader_at_cap(self) -> bool:
        """Contract 1: some rank was at the cap at the end of the previous step."""
        return max(t.item() for t in self.balance_queue) == self.max_num_running_reqs

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        if self._balance_enabled:
            self.admission_frozen = self.leader_at_cap()
        return super().schedule(throttle_prefills)  # type: ignore[misc]

    def _should_stop_admitting_waiting(self) -> bool:
        return super()._should_stop_admitting_waiting() or self.admission_frozen  # type: ignore[misc]


class BalanceScheduler(BalanceSchedulerMixin, Scheduler):
    """Balance on top of the synchronous ``Scheduler`` (needs the seam)."""


class BalanceAsyncScheduler(BalanceSchedulerMixin, AsyncScheduler):
    """Balance on top of ``AsyncScheduler``, which vLLM builds when async scheduling is on."""
