"""The DP engine core's part of balance scheduling: one gather per active step."""

from __future__ import annotations

from vllm.v1.engine.core import DPEngineCoreProc


class BalanceDPEngineCoreProc(DPEngineCoreProc):
    """``DPEngineCoreProc`` that triggers the scheduler's gather; nothing else is overridden.

    The gather sits immediately after ``super()._has_global_unfinished_reqs()``, the only
    per-iteration point where the DP ranks have just agreed on ``engines_running``. Upstream's
    ``run_busy_loop`` calls it exactly once on every non-idle iteration (dummy-batch iterations
    included) and skips it on every rank when all are idle, so every rank enters the same number
    of all_gathers. Timing equals the original engine-driven gather: after schedule, execute and
    ``update_from_output``; the gate consumes the result in the next ``schedule()``.

    Two other places were tried and deadlocked in production:

    - Lesson A, not inside ``schedule()``: a rank that has drained its local requests runs
      ``execute_dummy_batch()`` and never enters ``schedule()``; busy ranks then wait in the
      all_gather forever while the drained rank waits in the MoE collective.
    - Lesson B, not inside ``_process_engine_step()``: that runs before the cross-rank sync and
      before the idle ``continue``. At a wave boundary one rank reaches the gather while another
      is blocked in ``_process_input_queue()`` or ``future.result()``; the stuck engine core stops
      draining its workers' shared-memory channel and dies with "RPC call to sample_tokens timed
      out" after 60 s, intermittently (it depends on per-run finish timing).
    """

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        result = super()._has_global_unfinished_reqs(local_unfinished)
        self.scheduler.dp_group = self.dp_group  # type: ignore[attr-defined]
        self.scheduler.balance_gather()  # type: ignore[attr-defined]
        return result
