"""Negative controls on the real server: the gather placements that deadlocked in production.

Inactive unless ``VLLM_BALANCE_E2E_VARIANT`` names one (the e2e control tests set it in the
server's environment only). Then each engine core runs the shipped activation with the placement
of the gather replaced by the harness's variant (``balance_testbed.variants``, one definition for
both test beds):

- ``lesson_a``: the gather at the top of ``schedule()``, and an engine core that only injects
  the DP group (no gather after ``_has_global_unfinished_reqs``);
- ``drop_metrics``: the balance counters never join vLLM's stats (the metrics route's deliberate
  bug: run on a headless node only, the head's /metrics must miss that node's ranks; nothing
  else changes).

Why through ``run_engine_core``: an engine-core process activates balance in the wrapper the
front end hands it as its process target (``vllm_balance.activation``), before vLLM loads the
general plugins in that process, so a plugin registering there is too late. Here the front end's
plugin load swaps the target for ``variant_run_engine_core``, which installs the variant in the
engine-core process and then runs the shipped wrapper. A warning in every engine core says a
control is installed, so such a log is never mistaken for the shipped placement.
"""

from __future__ import annotations

import logging
import os

VARIANT_ENV = "VLLM_BALANCE_E2E_VARIANT"
VARIANTS = ("lesson_a", "drop_metrics")
logger = logging.getLogger("vllm.balance_e2e.variants")


def requested_variant() -> str | None:
    variant = os.environ.get(VARIANT_ENV) or None
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={variant!r}; known: {', '.join(VARIANTS)}")
    return variant


def install_variant(variant: str) -> None:
    """In this process, make activation install ``variant``'s placement instead of the shipped."""
    from balance_testbed import variants
    from vllm_balance import activation, registry

    assert variant == "lesson_a", variant
    select_shipped = activation.select_scheduler_cls

    def select_gather_in_schedule(vllm_config):
        scheduler_cls = variants.gather_in_schedule_scheduler(select_shipped(vllm_config))
        vllm_config.scheduler_config.scheduler_cls = scheduler_cls
        return scheduler_cls

    # activation.activate_for looks both names up at call time.
    activation.select_scheduler_cls = select_gather_in_schedule
    registry.DP_ENGINE_CORE_SWAP.replacement = variants.InjectDpGroupEngine
    logger.warning("NEGATIVE CONTROL %s: the gather is NOT at the shipped place", variant)


def variant_run_engine_core(*args, **kwargs):
    """Engine-core process target: install the requested variant, then the shipped wrapper."""
    from vllm_balance.activation import balance_run_engine_core

    install_variant(requested_variant())
    return balance_run_engine_core(*args, **kwargs)


def drop_metrics() -> None:
    """This process's balance schedulers queue their counters and never hand them over."""
    from vllm_balance.shim.metrics import BalanceMetrics

    def attach(self, stats):
        self.pending = {}
        return stats

    BalanceMetrics.attach = attach
    logger.warning("NEGATIVE CONTROL drop_metrics: balance counters are dropped in this process")


def register() -> None:
    """In the front end: hand the engine cores ``variant_run_engine_core`` as their target.

    ``drop_metrics`` instead applies in every process that loads plugins (the engine cores too).
    """
    variant = requested_variant()
    if variant is None:
        return
    if variant == "drop_metrics":
        drop_metrics()
        return
    from vllm_balance.registry import RUN_ENGINE_CORE_WRAPPER

    # Whichever plugin loads first, the variant's target ends up installed: the shipped plugin's
    # later install() finds its (replaced) replacement already in place and does nothing.
    RUN_ENGINE_CORE_WRAPPER.uninstall()
    RUN_ENGINE_CORE_WRAPPER.replacement = variant_run_engine_core  # installed as a staticmethod
    RUN_ENGINE_CORE_WRAPPER.install()
    logger.warning("engine cores will run the NEGATIVE CONTROL %s", variant)
