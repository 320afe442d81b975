"""The DP engine core's part of balance scheduling: one gather per active step."""

from __future__ import annotations

from typing import Any

from vllm.v1.engine.core import DPEngineCoreProc


class BalanceDPEngineCoreProc(DPEngineCoreProc):
    """``DPEngineCoreProc`` that triggers the scheduler's gather and hands it the DP group.

    The gather sits right after ``super()._has_global_unfinished_reqs()``, where the DP ranks have
    just agreed on ``engines_running``: every rank enters it once per active step, and none when
    all are idle. Inside ``schedule()`` (lesson A) or ``_process_engine_step()`` (lesson B) it
    deadlocked in production (docs/design.md, "Where the gather sits, and the two deadlocks").
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler.follow_dp_group(self.dp_group)  # type: ignore[attr-defined]

    @property  # type: ignore[override]
    def dp_group(self) -> Any:
        """vLLM's DP group. vLLM assigns it at start-up (before the scheduler exists) and again
        when it swaps in a group of another size, keeping the scheduler: an elastic-EP resize
        (``ElasticEPScalingState._commit_new_dp_group``). Each assignment is handed to the
        scheduler at once, so the step after a resize gathers and decides on the new group."""
        return self._balance_dp_group

    @dp_group.setter
    def dp_group(self, group: Any) -> None:
        self._balance_dp_group = group
        scheduler = getattr(self, "scheduler", None)  # None inside _init_data_parallel
        if scheduler is not None:
            scheduler.follow_dp_group(group)

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        result = super()._has_global_unfinished_reqs(local_unfinished)
        self.scheduler.balance_gather()  # type: ignore[attr-defined]
        return result
