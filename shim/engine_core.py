"""The DP engine core's part of balance scheduling: one gather per active step."""

from __future__ import annotations

from vllm.v1.engine.core import DPEngineCoreProc


class BalanceDPEngineCoreProc(DPEngineCoreProc):
    """``DPEngineCoreProc`` that triggers the scheduler's gather; nothing else is overridden.

    The gather sits right after ``super()._has_global_unfinished_reqs()``, where the DP ranks have
    just agreed on ``engines_running``: every rank enters it once per active step, and none when
    all are idle. Inside ``schedule()`` (lesson A) or ``_process_engine_step()`` (lesson B) it
    deadlocked in production (docs/design.md, "Where the gather sits, and the two deadlocks").
    """

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        result = super()._has_global_unfinished_reqs(local_unfinished)
        self.scheduler.dp_group = self.dp_group  # type: ignore[attr-defined]
        self.scheduler.balance_gather()  # type: ignore[attr-defined]
        return result
