"""vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls ``register()`` in every process that loads plugins: the front end before it creates
the engine config (so the wrapper is in place when the launcher pickles or forks
``EngineCoreProc.run_engine_core``), and each engine core and worker. Registering installs the
``run_engine_core`` wrapper, which decides per engine process from that process's config. It is
the one vLLM object this package changes with balance off, and the only one it must: a general
plugin runs before any config exists, and ``run_engine_core`` is the first code of an engine-core
process that has the process's ``VllmConfig`` in hand (the DP engine-core class and the scheduler
class are chosen after it). With balance off the wrapper passes straight through
(``config.balance_mentioned``): nothing is read, imported, initialised or swapped.

The API server decodes each engine's balance counters (``registry.STATS_DECODED_WITH_BALANCE``)
only where ``VLLM_BALANCE_METRICS=1`` asks for it: it must be in place before vLLM builds its
engine client, when the plugin cannot yet know whether balance is on. With the Ray DP backend
(where ``ray`` is importable) the API server's ``CoreEngineActorManager.__init__`` gets a second
wrapper, for the same reason: Ray never calls ``run_engine_core``, and that constructor is where
vLLM picks the engine-core actors' class with the config in hand (``vllm_balance.ray_actor``);
with balance off it too passes straight through.

Next to vllm-ascend, whose platform patches wrap ``run_engine_core`` too, the wrapper must be
reached whatever the plugin order: vllm-ascend's patches are applied first (its own plugins do the
same in this process; idempotent), so that ours goes on top, unless ours is in place already and
another wrapper captured it since (installing it again would make it call itself).
"""

from __future__ import annotations

from vllm_balance.log import logger


def register() -> None:
    from vllm_balance.ascend.takeover import import_vllm_ascend_patches
    from vllm_balance.config import metrics_decoding_requested
    from vllm_balance.registry import (
        RAY_ACTOR_MANAGER_WRAPPER,
        RUN_ENGINE_CORE_WRAPPER,
        STATS_DECODED_WITH_BALANCE,
        ray_backend_present,
    )

    import_vllm_ascend_patches()
    if not RUN_ENGINE_CORE_WRAPPER.is_applied():
        RUN_ENGINE_CORE_WRAPPER.install()
    if metrics_decoding_requested():
        STATS_DECODED_WITH_BALANCE.install()
    # The API server chooses the Ray actors' class: vllm_balance.ray_actor.
    if ray_backend_present():
        RAY_ACTOR_MANAGER_WRAPPER.install()
    logger.debug(
        "vllm-balance-scheduling plugin registered (%s wrapped)", RUN_ENGINE_CORE_WRAPPER.name
    )
