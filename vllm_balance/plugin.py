"""vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls ``register()`` in every process that loads plugins: the front end before it creates
the engine config (so the wrapper is in place when the launcher pickles or forks
``EngineCoreProc.run_engine_core``), and each engine core and worker. Registering installs only
the ``run_engine_core`` wrapper, which decides per engine process from that process's config;
with balance off it restores upstream's ``DPEngineCoreProc`` and touches nothing else, so every
upstream class stays the identical object.
"""

from __future__ import annotations

from vllm_balance.log import logger


def register() -> None:
    from vllm_balance.registry import RUN_ENGINE_CORE_WRAPPER

    RUN_ENGINE_CORE_WRAPPER.install()
    logger.debug(
        "vllm-balance-scheduling plugin registered (%s wrapped)", RUN_ENGINE_CORE_WRAPPER.name
    )
