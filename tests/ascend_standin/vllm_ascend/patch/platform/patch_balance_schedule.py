"""Stand-in for vllm-ascend's balance patch: the same name swaps, in the same order.

Real: vllm-ascend 182b75ea84ff13ece27b57391331ef8935410aea,
``vllm_ascend/patch/platform/patch_balance_schedule.py`` (912 lines). The real module cannot be
imported on CPU (it needs the Ascend toolkit through ``vllm_ascend.ascend_config``); this one
performs its module-level effects on vLLM line by line, nothing else. Its classes are markers:
the real ones carry a ``schedule()`` copy and the engine-core gather hook, which tests here must
never reach (they check that no ``vllm_ascend`` class runs).

Here -> real line: effect.

- imports of ``Scheduler``, ``DPEngineCoreProc``, ``EngineCoreProc`` -> L63-64, L73, L75:
  vLLM's classes bound before any swap.
- ``_balance_scheduling_enabled`` -> L84-101: AscendConfig first (it raises when not initialised,
  always on CPU, and the real code then falls through), then the nested, then the top-level
  ``additional_config`` key, ``bool()``.
- ``BalanceScheduler(Scheduler)`` -> L104; ``BalanceDPEngineCoreProc(DPEngineCoreProc)`` -> L835.
- ``scheduler_module.Scheduler = BalanceScheduler`` -> L889: unconditional, at import.
- ``_OriginalDPEngineCoreProc``, ``_OriginalRunEngineCore`` -> L899-900: captured at import,
  whatever is there then (ours, if our plugin registered first).
- ``_balance_run_engine_core`` -> L903-909: balance on, ``DPEngineCoreProc`` becomes
  ``BalanceDPEngineCoreProc``, else the captured class; then the captured function is called.
- ``EngineCoreProc.run_engine_core = staticmethod(...)`` -> L912: unconditional, at import.
"""

import vllm.v1.core.sched.scheduler as scheduler_module
import vllm.v1.engine.core as engine_core_module
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc

KEY = "enable_balance_scheduling"


def _balance_scheduling_enabled(vllm_config) -> bool:
    additional = getattr(vllm_config, "additional_config", None) or {}
    nested = additional.get("scheduler_config")
    if isinstance(nested, dict) and KEY in nested:
        return bool(nested[KEY])
    return bool(additional.get(KEY, False))


class BalanceScheduler(Scheduler):
    """Marker for vllm-ascend's BalanceScheduler (a v0.24.0 ``schedule()`` copy there)."""


class BalanceDPEngineCoreProc(DPEngineCoreProc):
    """Marker for vllm-ascend's BalanceDPEngineCoreProc (its gather hook there)."""


scheduler_module.Scheduler = BalanceScheduler

_OriginalDPEngineCoreProc = engine_core_module.DPEngineCoreProc
_OriginalRunEngineCore = EngineCoreProc.run_engine_core


def _balance_run_engine_core(*args, dp_rank: int = 0, local_dp_rank: int = 0, **kwargs):
    if _balance_scheduling_enabled(kwargs.get("vllm_config")):
        engine_core_module.DPEngineCoreProc = BalanceDPEngineCoreProc
    else:
        engine_core_module.DPEngineCoreProc = _OriginalDPEngineCoreProc
    return _OriginalRunEngineCore(*args, dp_rank=dp_rank, local_dp_rank=local_dp_rank, **kwargs)


EngineCoreProc.run_engine_core = staticmethod(_balance_run_engine_core)
