"""Stand-in for vllm-ascend's DyntraLB patch: its second wrapper on ``run_engine_core``.

Real: vllm-ascend 182b75ea84ff13ece27b57391331ef8935410aea,
``vllm_ascend/patch/platform/patch_dyntra_lb_core.py`` (547 lines). Imported right after the
balance patch (``platform/__init__.py`` L40), it wraps ``run_engine_core`` once more.

Here -> real line: effect.

- ``import ... patch_balance_schedule as _balance_patch`` -> L30: the balance patch runs first.
- ``DyntraLBDPEngineCoreProc(DPEngineCoreProc)`` -> L123: marker.
- ``_PreviousRunEngineCore``, ``_UpstreamRunEngineCore``, ``_OriginalDPEngineCoreProc`` ->
  L523-525: captured at import; "upstream" is the function the balance patch captured.
- ``_dyntra_lb_run_engine_core`` -> L528-543: DyntraLB off (always, in these tests), call the
  previous wrapper; on, swap ``DPEngineCoreProc``, call "upstream", restore.
- ``EngineCoreProc.run_engine_core = staticmethod(...)`` -> L547: unconditional, at import.

After the vllm-ascend series (``upstream_patch/vllm-ascend/``) the balance module keeps no
``_OriginalRunEngineCore`` and DyntraLB calls what it wrapped; the ``getattr`` below follows
whichever balance module is installed.
"""

import vllm.v1.engine.core as engine_core_module
from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc

import vllm_ascend.patch.platform.patch_balance_schedule as _balance_patch

DYNTRA_KEY = "dyntra_lb_config"


class DyntraLBDPEngineCoreProc(DPEngineCoreProc):
    """Marker for vllm-ascend's DyntraLB engine core."""


def _dyntra_lb_enabled(vllm_config) -> bool:
    additional = getattr(vllm_config, "additional_config", None) or {}
    config = (additional.get("scheduler_config") or {}).get(DYNTRA_KEY) or {}
    return bool(config.get("enabled", False))


_PreviousRunEngineCore = EngineCoreProc.run_engine_core
_UpstreamRunEngineCore = getattr(_balance_patch, "_OriginalRunEngineCore", _PreviousRunEngineCore)
_OriginalDPEngineCoreProc = DPEngineCoreProc


def _dyntra_lb_run_engine_core(*args, dp_rank: int = 0, local_dp_rank: int = 0, **kwargs):
    if not _dyntra_lb_enabled(kwargs.get("vllm_config")):
        return _PreviousRunEngineCore(*args, dp_rank=dp_rank, local_dp_rank=local_dp_rank, **kwargs)
    engine_core_module.DPEngineCoreProc = DyntraLBDPEngineCoreProc
    try:
        return _UpstreamRunEngineCore(*args, dp_rank=dp_rank, local_dp_rank=local_dp_rank, **kwargs)
    finally:
        engine_core_module.DPEngineCoreProc = _OriginalDPEngineCoreProc


EngineCoreProc.run_engine_core = staticmethod(_dyntra_lb_run_engine_core)
