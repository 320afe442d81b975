"""Stand-in for vllm-ascend's plugin entry points (see tests/ascend_standin/README.md).

Real: vllm-ascend 182b75ea84ff13ece27b57391331ef8935410aea, ``vllm_ascend/__init__.py`` and
``setup.py`` lines 518-525 (entry points, mirrored in ``vllm_ascend_standin-0.0.0.dist-info``).

- L44-61 ``_ensure_global_patch()``: once per process, ``adapt_patch(is_global_patch=True)``
  (``vllm_ascend/utils.py`` L529-531), i.e. ``from vllm_ascend.patch import platform``.
- L70/L80/L90: the general plugins ``register_connector``, ``register_model_loader`` and
  ``register_service_profiling`` call it first; ``register_model`` (L98) does not. What they do
  next (connectors, loaders, profiling, models) does not touch the names balance cares about
  and is left out.
- L64 ``register()``, the platform plugin, is not stood in: on CPU it would make vLLM pick the
  NPU platform. Its hook ``NPUPlatform.pre_register_and_update`` (``platform.py`` L261-265)
  applies the same idempotent import, and vLLM calls it only after ``load_general_plugins()``
  (vLLM 0.24.0 ``engine/arg_utils.py`` L2673 then L2685, L757 then L1794; 0.25.0 L2695 then
  L2707, L762 then L1828), so it never changes which patch lands first.
"""

_GLOBAL_PATCH_APPLIED = False


def _ensure_global_patch() -> None:
    global _GLOBAL_PATCH_APPLIED
    if _GLOBAL_PATCH_APPLIED:
        return
    import vllm_ascend.patch.platform  # noqa: F401

    _GLOBAL_PATCH_APPLIED = True


def register_connector() -> None:
    _ensure_global_patch()


def register_model_loader() -> None:
    _ensure_global_patch()


def register_service_profiling() -> None:
    _ensure_global_patch()


def register_model() -> None:
    return None
