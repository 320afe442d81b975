"""Negative controls on the real server: the gather placements that deadlocked in production.

Inactive unless ``VLLM_BALANCE_E2E_VARIANT`` names one (the e2e control tests set it, together
with ``PYTHONPATH`` at the repository root, in the server's environment only). Then, in each
engine-core process, the shipped activation still validates the config and picks the balance
scheduler, but the placement of the gather is replaced by the harness's variant
(``tests/multiproc/variants.py``, one definition for both test beds):

- ``lesson_a``: the gather at the top of ``schedule()``, and an engine core that only injects
  the DP group (no gather after ``_has_global_unfinished_reqs``);
- ``lesson_b``: the gather at the end of ``_process_engine_step()``.

A loud warning in every engine core says a control is installed, so such a log is never
mistaken for the shipped placement.
"""

from __future__ import annotations

import logging
import os

VARIANT_ENV = "VLLM_BALANCE_E2E_VARIANT"
VARIANTS = ("lesson_a", "lesson_b")
logger = logging.getLogger("vllm.balance_e2e.variants")


def register() -> None:
    variant = os.environ.get(VARIANT_ENV)
    if not variant:
        return
    if variant not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={variant!r}; known: {', '.join(VARIANTS)}")
    from tests.multiproc import variants
    from vllm_balance import activation, registry

    if variant == "lesson_a":
        select_shipped = activation.select_scheduler_cls

        def select_gather_in_schedule(vllm_config):
            scheduler_cls = variants.gather_in_schedule_scheduler(select_shipped(vllm_config))
            vllm_config.scheduler_config.scheduler_cls = scheduler_cls
            return scheduler_cls

        # activation.activate_for looks both names up at call time.
        activation.select_scheduler_cls = select_gather_in_schedule
        registry.DP_ENGINE_CORE_SWAP.replacement = lambda: variants.InjectDpGroupEngine
    else:
        registry.DP_ENGINE_CORE_SWAP.replacement = lambda: variants.GatherInEngineStepEngine
    logger.warning("NEGATIVE CONTROL %s: the gather is NOT at the shipped place", variant)
