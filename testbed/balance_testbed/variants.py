"""Negative controls: the two gather placements that deadlocked in production, and a wrong
log-depth reduction.

They exist only in the test suite, to prove the harness can see the deadlocks the shipped hook
(``vllm_balance.shim.engine_core.BalanceDPEngineCoreProc``) avoids, and a reduction whose gate
differs from the all_gather's. Each is the smallest change from the shipped design that
reproduces one bug; all keep the real balance scheduler.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine.core import DPEngineCoreProc

from vllm_balance.shim import collective


class InjectDpGroupEngine(DPEngineCoreProc):
    """Upstream DP engine core (no gather in the loop) that hands its DP group to the scheduler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler.follow_dp_group(self.dp_group)  # type: ignore[attr-defined]


def gather_in_schedule_scheduler(base: type) -> type:
    """Lesson A: the all_gather at the top of ``schedule()``.

    A rank whose local requests have drained runs ``execute_dummy_batch()`` and never enters
    ``schedule()``: busy ranks wait in this all_gather while the drained rank waits in the MoE
    collective of its dummy batch.
    """

    class GatherInScheduleScheduler(base):  # type: ignore[misc, valid-type]
        def schedule(self, throttle_prefills: bool = False):
            self.balance_gather()
            return super().schedule(throttle_prefills)

    return GatherInScheduleScheduler


class GatherInEngineStepEngine(DPEngineCoreProc):
    """Lesson B: the all_gather at the end of ``_process_engine_step()``.

    Same timing as the pre-refactor gather (after schedule, execute and update_from_output), but
    before the cross-rank ``_has_global_unfinished_reqs`` sync and before the idle ``continue``.
    When one rank steps its model while another has no runnable request (it was just woken for
    the wave by START_DP_WAVE, or drained early), the busy rank blocks inside the forward
    (``future.result()``, the MoE collective) before reaching the gather, and the other rank
    reaches the gather before running its dummy forward: each waits for the other.
    """

    def _process_engine_step(self) -> bool:
        executed = super()._process_engine_step()
        self.scheduler.follow_dp_group(self.dp_group)  # type: ignore[attr-defined]
        self.scheduler.balance_gather()  # type: ignore[attr-defined]
        return executed


def late_fold_in_reduce(
    running: int, group: Any, timeout: Any = collective.NO_TIMEOUT
) -> collective.Reduced:
    """``collective.reduce_running`` with the extra ranks folded in after the doubling.

    Wrong on purpose (DP not a power of two): an extra rank's count reaches only its partner,
    which hands the result back, so the other ranks decide the gate without it. Every send still
    has its receive: it returns, with a different answer on some ranks.
    """
    rank, world = group.rank(), group.size()
    core = collective.fold_size(world)
    values = collective.initial(running)
    if rank >= core:  # the extra ranks' part is unchanged
        collective._send(group, values, rank - core, tag=0).wait()
        return collective.result(collective._recv(group, rank - core, tag=0, like=values))
    collective.double(values, group, rank, core)
    if rank + core < world:
        collective.combine(values, collective._recv(group, rank + core, tag=0, like=values))
        collective._send(group, values, rank + core, tag=0).wait()
    return collective.result(values)
