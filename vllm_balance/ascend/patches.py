"""The take-over's run-time patches: vLLM's own objects put back where vllm-ascend's balance
patch replaced them (``vllm_balance.ascend.takeover``), in ``vllm_balance.registry``'s form and
paperwork. Installed only in take-over mode.
"""

from __future__ import annotations

from typing import Any

from vllm_balance.registry import RuntimePatch, engine_core_module, engine_core_proc


def scheduler_module() -> Any:
    import vllm.v1.core.sched.scheduler

    return vllm.v1.core.sched.scheduler


def async_scheduler_module() -> Any:
    # Imported here at the earliest after TAKE_OVER_SCHEDULER: a first import then binds vLLM's
    # own Scheduler as AsyncScheduler's base, and there is nothing to rebuild.
    import vllm.v1.core.sched.async_scheduler

    return vllm.v1.core.sched.async_scheduler


# The take-over entries (vllm_balance.ascend.takeover) put back what vllm-ascend replaced. For all
# four (AsyncScheduler adds a Why of its own):
#   Why:
#     vllm-ascend's patch_balance_schedule.py (and DyntraLB's wrapper on top of it) replaces this
#     name at import, unconditionally, in every process that applies vllm-ascend's platform patches;
#     two balance implementations in one engine core gather twice per step
#   Related PR:
#     vllm-ascend: upstream_patch/vllm-ascend/ (patch_balance_schedule.py delegates to this package
#     instead of swapping names)
#   Future Plan:
#     delete with vllm_balance/ascend/ once vllm-ascend delegates

# vllm.v1.core.sched.scheduler.Scheduler (take-over)
#   How:
#     vLLM's own Scheduler (the vLLM class in the swapped class's MRO) put back
TAKE_OVER_SCHEDULER = RuntimePatch(
    name="vllm.v1.core.sched.scheduler.Scheduler (take-over)",
    owner=scheduler_module,
    attribute="Scheduler",
    replacement="vllm_balance.ascend.takeover:vllm_scheduler",
    computed=True,
)

# vllm.v1.core.sched.async_scheduler.AsyncScheduler (take-over)
#   Why:
#     AsyncScheduler binds Scheduler when its module is first imported; imported after vllm-ascend's
#     swap (its platform imports recompute_scheduler, which imports it), its base is vllm-ascend's
#     BalanceScheduler and the schedule() copy sits in its MRO
#   How:
#     when the class has a vllm-ascend class in its MRO: the module's code executed again (not
#     re-imported) with vLLM's Scheduler back in place, its AsyncScheduler put back
TAKE_OVER_ASYNC_SCHEDULER = RuntimePatch(
    name="vllm.v1.core.sched.async_scheduler.AsyncScheduler (take-over)",
    owner=async_scheduler_module,
    attribute="AsyncScheduler",
    replacement="vllm_balance.ascend.takeover:vllm_async_scheduler",
    computed=True,
)

# vllm.v1.engine.core.DPEngineCoreProc (take-over)
#   How:
#     vLLM's own DPEngineCoreProc (the vLLM class in the swapped class's MRO) put back
TAKE_OVER_DP_ENGINE_CORE = RuntimePatch(
    name="vllm.v1.engine.core.DPEngineCoreProc (take-over)",
    owner=engine_core_module,
    attribute="DPEngineCoreProc",
    replacement="vllm_balance.ascend.takeover:vllm_dp_engine_core",
    computed=True,
)

# EngineCoreProc.run_engine_core (take-over)
#   How:
#     vLLM's own function (found by walking the wrappers) put back as the staticmethod
TAKE_OVER_RUN_ENGINE_CORE = RuntimePatch(
    name="EngineCoreProc.run_engine_core (take-over)",
    owner=engine_core_proc,
    attribute="run_engine_core",
    replacement="vllm_balance.ascend.takeover:vllm_run_engine_core",
    computed=True,
    static=True,
)

# Install order: Scheduler before AsyncScheduler (the rebuild needs vLLM's Scheduler in place).
TAKE_OVER_PATCHES: tuple[RuntimePatch, ...] = (
    TAKE_OVER_SCHEDULER,
    TAKE_OVER_ASYNC_SCHEDULER,
    TAKE_OVER_DP_ENGINE_CORE,
    TAKE_OVER_RUN_ENGINE_CORE,
)
