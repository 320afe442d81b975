"""The pins are what the sessions import: one exact vLLM per pin file, the release tag the one
vllm-ascend's newest pinned release targets."""

from __future__ import annotations

import pytest
from conftest import session_pin_name
from packaging.version import Version

from balance_testbed.pins import DISTRIBUTIONS, PIN_NAMES, read_pin, read_vllm_ascend_pins

pytestmark = pytest.mark.path_independent


def test_session_imports_the_vllm_its_pin_file_names():
    import vllm

    name = session_pin_name()
    if name is None:
        pytest.skip("not running under a nox session (VLLM_BALANCE_PIN unset)")
    pin = read_pin(name)
    if pin.version is None:
        pytest.skip(f"{pin.label} is not an exact version; nothing to compare")
    assert vllm.__version__ == pin.version, f"{pin.label} but imported vllm {vllm.__version__}"


@pytest.mark.parametrize("name", PIN_NAMES)
def test_pin_files_hold_one_exact_vllm_requirement(name):
    pin = read_pin(name)
    assert pin.requirement == f"{DISTRIBUTIONS[name]}=={pin.version}"


def test_release_tag_is_the_vllm_the_newest_pinned_vllm_ascend_release_targets():
    """pins/release-tag.txt: the release tag is what production on Ascend runs."""
    newest = max(read_vllm_ascend_pins(), key=lambda pin: Version(pin.release))
    assert read_pin("release-tag").version == newest.vllm, (
        f"vllm-ascend {newest.release} (pins/vllm-ascend.txt) targets vLLM {newest.vllm}: "
        "advance pins/release-tag.txt to it, or pin the vllm-ascend release that targets it"
    )
