"""Which scheduler a run of vLLM's own tests imports (upstream_patch/run_vllm_tests.py), and the
record of it the script checks.

``vllm_own_conftest`` imports it first; with ``--vllm-conftest`` (vLLM's own conftest files,
``VLLM_TARGET_DEVICE=cpu``) it is the pytest plugin (``-p balance_testbed.vllm_own_side``),
which pytest loads before any conftest.
"""

import importlib.util
import json
import os
import sys

SCHEDULER = "vllm.v1.core.sched.scheduler"


def install() -> None:
    """Import ``VLLM_BALANCE_SCHEDULER_FILE`` (if set) as vLLM's scheduler module; must happen
    before any test module imports the scheduler."""
    override = os.environ.get("VLLM_BALANCE_SCHEDULER_FILE")
    if not override or getattr(sys.modules.get(SCHEDULER), "__file__", None) == override:
        return
    assert SCHEDULER not in sys.modules, "scheduler imported before the side was chosen"
    import vllm.v1.core.sched as package

    spec = importlib.util.spec_from_file_location(SCHEDULER, override)
    module = importlib.util.module_from_spec(spec)
    sys.modules[SCHEDULER] = module
    spec.loader.exec_module(module)
    package.scheduler = module


def record(balance_classes=()) -> None:
    """What this side runs, for the script: the scheduler file, whether it has the seam, and the
    balance classes swapped in (if any)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    with open(os.environ["VLLM_BALANCE_SIDE_FILE"], "w") as out:
        json.dump(
            {
                "scheduler_file": sys.modules[SCHEDULER].__file__,
                "has_seam": hasattr(Scheduler, "_should_stop_admitting_waiting"),  # the seam
                "balance_classes": sorted(
                    f"{cls.__module__}.{cls.__qualname__}" for cls in balance_classes
                ),
            },
            out,
        )


install()


def pytest_configure(config):
    # As a plugin (vLLM's own conftest): nothing else records the side.
    record()
