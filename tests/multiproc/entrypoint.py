"""The full engine through vLLM's own launcher: front-end client, DP coordinator, engine processes.

    python -m tests.multiproc.entrypoint [DP] [OPTIONS_JSON]    # prints one JSON line

Nothing here plays a vLLM role: ``EngineCoreClient.make_async_mp_client`` (the ``AsyncLLM`` path)
starts vLLM's ``DPCoordinator`` process and one process per DP rank whose target is
``EngineCoreProc.run_engine_core``, which is our activation wrapper because vLLM's
``load_general_plugins()`` ran the package's plugin first, as in a front end. The only stand-in
is the executor class, passed like any ``distributed_executor_backend`` class. ``OPTIONS_JSON``
may add ``additional_config`` keys and set ``async_scheduling``; vLLM's own
``VLLM_WORKER_MULTIPROC_METHOD`` picks fork or spawn for the engine processes.

Each engine process is then asked (``collective_rpc("harness_engine_facts")``) what it runs, so
the test sees the activation wrapper, the module-name swap and the scheduler selection as they
happened in processes vLLM created.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def drive(dp_size: int, options: dict | None = None) -> dict:
    from vllm.plugins import load_general_plugins
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core_client import EngineCoreClient

    from balance_testbed.factories import make_vllm_config
    from tests.multiproc.standin import StandInExecutor
    from tests.multiproc.traces import CAP

    options = options or {}
    load_general_plugins()
    vllm_config = make_vllm_config(
        moe=True,
        max_num_seqs=CAP,
        max_model_len=2048,
        data_parallel_size=dp_size,
        additional_config={
            "enable_balance_scheduling": True,
            **options.get("additional_config", {}),
        },
        async_scheduling=options.get("async_scheduling", False),
    )
    # All ranks on this host (ParallelConfig defaults to one local rank, and the launcher then
    # waits for the others to connect from elsewhere).
    vllm_config.parallel_config.data_parallel_size_local = dp_size
    started = time.monotonic()
    client = EngineCoreClient.make_async_mp_client(vllm_config, StandInExecutor, False)
    try:
        startup_seconds = time.monotonic() - started
        expected = {}
        for i in range(3 * dp_size):
            request_id = f"entry-{i}"
            expected[request_id] = 3 + i
            await client.add_request_async(
                EngineCoreRequest(
                    request_id=request_id,
                    prompt_token_ids=[1 + (i * 7 + j) % 500 for j in range(8 + i)],
                    mm_features=None,
                    sampling_params=SamplingParams(max_tokens=3 + i, ignore_eos=True),
                    pooling_params=None,
                    arrival_time=time.time(),
                    lora_request=None,
                    cache_salt=None,
                    data_parallel_rank=i % dp_size,
                )
            )
        tokens = dict.fromkeys(expected, 0)
        finished: set[str] = set()
        deadline = time.monotonic() + 120
        while len(finished) < len(expected) and time.monotonic() < deadline:
            outputs = await asyncio.wait_for(client.get_output_async(), timeout=60)
            for output in outputs.outputs:
                tokens[output.request_id] += len(output.new_token_ids)
                if output.finish_reason is not None:
                    finished.add(output.request_id)
        # call_utility_async returns only the first engine's answer; ask each engine directly.
        facts = [
            (
                await client._call_utility_async(
                    "collective_rpc", "harness_engine_facts", engine=engine
                )
            )[0]
            for engine in client.core_engines
        ]
        return {
            "startup_seconds": startup_seconds,
            "expected": expected,
            "tokens": tokens,
            "finished": sorted(finished),
            "facts": facts,
        }
    finally:
        client.shutdown()


def main() -> None:
    import faulthandler
    import os
    import signal

    mutant = os.environ.get("VLLM_BALANCE_MUTANT", "none")
    if mutant != "none":
        # tests/mutation/run.py (which puts tests/mutation/ on PYTHONPATH) applied a deliberately
        # wrong variant in the pytest process; this is another interpreter, and vLLM forks the
        # engine processes from it, so apply it here as well.
        import mutants

        mutants.apply(mutant)
    # Inherited by the engine processes vLLM forks: SIGUSR1 dumps any of them (hang diagnosis).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    dp_size = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    print("ENTRYPOINT-RESULT " + json.dumps(asyncio.run(drive(dp_size, options))), flush=True)


if __name__ == "__main__":
    main()
