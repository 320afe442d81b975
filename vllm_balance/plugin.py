"""vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls ``register()`` in every process that loads plugins: the front end before it creates
the engine config (so the wrapper is in place when the launcher pickles or forks
``EngineCoreProc.run_engine_core``), and each engine core and worker. Registering installs
the ``run_engine_core`` wrapper, which decides per engine process from that process's config;
with balance off it restores upstream's ``DPEngineCoreProc`` and touches nothing else, so every
upstream class stays the identical object. It also makes the API server decode engine stats with
the field that carries each rank's balance counters (``registry.STATS_DECODED_WITH_BALANCE``):
the front end cannot know yet whether balance is on, and it must be in place before vLLM builds
its engine client; with balance off no engine fills the field. With the Ray DP backend the front
end also chooses the engine-core actors' class (``vllm_balance.ray_actor``).

Next to vllm-ascend, whose platform patches wrap ``run_engine_core`` too, the wrapper must be
reached whatever the plugin order: vllm-ascend's patches are applied first (idempotent, as its own
plugins do), so that ours goes on top, unless ours is already part of the chain (a vllm-ascend
that delegates registers it and wraps it again): installing it twice would make it call itself.
"""

from __future__ import annotations

from vllm_balance.log import logger


def register() -> None:
    from vllm_balance.activation import RAY_ACTOR_MANAGER_WRAPPER, RUN_ENGINE_CORE_WRAPPER
    from vllm_balance.registry import STATS_DECODED_WITH_BALANCE, ray_backend_present
    from vllm_balance.takeover import import_vllm_ascend_patches, run_engine_core_reach

    import_vllm_ascend_patches()
    ours = RUN_ENGINE_CORE_WRAPPER.replacement().__func__
    if ours not in run_engine_core_reach(RUN_ENGINE_CORE_WRAPPER.current()):
        RUN_ENGINE_CORE_WRAPPER.install()
    STATS_DECODED_WITH_BALANCE.install()
    if (
        ray_backend_present()
    ):  # the API server chooses the Ray actors' class: vllm_balance.ray_actor
        RAY_ACTOR_MANAGER_WRAPPER.install()
    logger.debug(
        "vllm-balance-scheduling plugin registered (%s wrapped)", RUN_ENGINE_CORE_WRAPPER.name
    )
