"""Smoke run: build a real vLLM Scheduler on CPU, drive requests to completion, print one line.

``python tests/smoke.py`` (also ``nox -s smoke``, once per pin).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def smoke_report(num_requests: int = 64, max_num_seqs: int = 16) -> str:
    import vllm

    from balance_testbed import factories
    from vllm_balance.selection import active_path

    started = time.perf_counter()
    scheduler = factories.make_scheduler(max_num_seqs=max_num_seqs, num_gpu_blocks=2048)
    requests = factories.make_requests(num_requests, prompt_len=48, max_tokens=6)
    factories.add_requests(scheduler, requests)
    steps = factories.run_to_completion(scheduler)
    block_pool = scheduler.kv_cache_manager.block_pool
    finished = sum(r.is_finished() for r in requests)
    tokens = sum(r.num_output_tokens for r in requests)
    elapsed = time.perf_counter() - started
    ok = (
        finished == num_requests
        and block_pool.get_num_free_blocks() == block_pool.num_gpu_blocks - 1
    )
    return (
        f"{'OK' if ok else 'FAIL'} vllm {vllm.__version__}: real Scheduler, "
        f"{num_requests} requests "
        f"finished={finished} output_tokens={tokens} steps={steps} "
        f"free_blocks={block_pool.get_num_free_blocks()}/{block_pool.num_gpu_blocks - 1} "
        f"balance path={active_path()} in {elapsed:.2f}s"
    )


def main() -> int:
    line = smoke_report()
    print(line)
    return 0 if line.startswith("OK") else 1


if __name__ == "__main__":
    sys.exit(main())
