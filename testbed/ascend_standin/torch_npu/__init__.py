"""Stand-in for ``torch_npu`` (Ascend's PyTorch backend), which cannot load without the Ascend
toolkit: just enough for vllm-ascend's platform patches and plugins to import on CPU.

Written for this repository (its README.md). Everything in ``torch_npu`` is device
code, so every name and submodule vllm-ascend imports from it (``torch_npu._C``,
``torch_npu._C._distributed_c10d``, ``npu_fusion_attention``, dtype constants, ...) is a
``MagicMock``: PEP 562's module ``__getattr__`` for names, a meta-path finder for submodules. What
the real package also does to ``torch`` when imported is done too: it registers ``torch.npu``
(annotations such as ``torch.npu.Event`` are evaluated at import; here it reports no device) and
adds ``torch.distributed.is_hccl_available`` (here: no HCCL). No test reaches a device call: the
engine cores stop before their executor exists.
"""

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from unittest.mock import MagicMock

import torch


def __getattr__(name: str) -> MagicMock:
    if name.startswith("__"):
        raise AttributeError(name)
    value = MagicMock(name=f"torch_npu.{name}")
    globals()[name] = value
    return value


class _MockSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``torch_npu.<anything>`` imports as a package whose names are mocks."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda name: MagicMock(name=f"{spec.name}.{name}")  # type: ignore[method-assign]
        return module

    def exec_module(self, module):
        return None


sys.meta_path.append(_MockSubmodules())
__path__: list[str] = []  # a package: its submodules come from the finder above

npu = MagicMock(name="torch.npu")
npu.is_available.return_value = False
npu.device_count.return_value = 0
torch.npu = npu  # type: ignore[attr-defined]
sys.modules["torch.npu"] = npu
torch.distributed.is_hccl_available = lambda: False  # type: ignore[attr-defined]
