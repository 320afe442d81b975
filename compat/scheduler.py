"""The Phase 2A balance schedulers: the shim's mixin in front of the derived ``schedule()``.

MRO: ``BalanceSchedulerMixin.schedule`` (the gate's decision, once per step) ->
``Phase2ASchedule.schedule`` (upstream's body + the Phase 2A deltas; balance off delegates
straight to ``super().schedule``) -> upstream ``Scheduler.schedule``. For the async variant the
MRO places ``AsyncScheduler`` after ``Phase2ASchedule``, so its ``_update_after_schedule`` and
friends still apply and delta 1 reaches upstream through it. The mixin's seam override is never
called here: the derived loop reads ``balance_gate.frozen`` itself (delta 2).

Importing this module derives the method (see ``derive``); it fails closed with
``Phase2AUnavailable`` on a vLLM whose ``schedule()`` is not verified.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from vllm_balance.compat.derive import derive_phase2a_schedule
from vllm_balance.shim.scheduler import BalanceSchedulerMixin

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

    class Phase2ASchedule(Scheduler):
        """What type checkers see: the derived class has upstream's interface."""

else:
    Phase2ASchedule = derive_phase2a_schedule()


class CompatBalanceScheduler(BalanceSchedulerMixin, Phase2ASchedule):
    """Balance on the synchronous ``Scheduler`` of a vLLM without the seam."""


class CompatBalanceAsyncScheduler(BalanceSchedulerMixin, Phase2ASchedule, AsyncScheduler):
    """Balance on ``AsyncScheduler`` (vLLM's default) of a vLLM without the seam."""
