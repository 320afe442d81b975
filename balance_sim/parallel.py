"""Policy runs in parallel processes, one per core.

Each run replays its workload on its own cluster of real schedulers and depends on nothing but
its options and policy, so runs are independent and their numbers do not depend on which
process ran them (a test compares the JSON of a parallel and an in-process run byte for byte).
Workers are spawned, not forked: a fork of a process that has run torch can inherit a held lock
of its thread pool, and spawning costs one vLLM import per worker, once per pool.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from balance_sim.runner import (
    PolicyRun,
    SimOptions,
    Workload,
    build_workload,
    quiet_vllm_logs,
    run_policy,
    show_balance_log_lines,
)


@dataclass(frozen=True)
class Job:
    options: SimOptions
    policy: str
    keep_record: bool = True  # False: return the summary only (a sweep of hundreds of runs)


def available_cores() -> int:
    """The cores this process may run on (the default number of worker processes)."""
    return len(os.sched_getaffinity(0))


@functools.lru_cache(maxsize=16)
def cached_workload(options: SimOptions) -> Workload:
    return build_workload(options)


def _run_job(index: int, job: Job, report: Callable[[int, int], None]) -> PolicyRun:
    run = run_policy(
        job.options,
        job.policy,
        cached_workload(job.options),
        lambda cluster: report(index, cluster.completed),
    )
    return run if job.keep_record else dataclasses.replace(run, record=None)


# -- worker side -------------------------------------------------------------------------------
_completed: Any = None  # the parent's shared array: completed requests per job


def _init_worker(completed: Any, log_interval_s: float) -> None:
    global _completed
    _completed = completed
    quiet_vllm_logs()
    if log_interval_s:
        show_balance_log_lines(log_interval_s)


def _report_to_parent(index: int, completed: int) -> None:
    _completed[index] = completed


def _run_in_worker(index: int, job: Job) -> PolicyRun:
    return _run_job(index, job, _report_to_parent)


# -- parent side -------------------------------------------------------------------------------
def run_jobs(
    jobs: Sequence[Job],
    processes: int = 1,
    progress: bool = False,
    log_interval_s: float = 0.0,
    on_result: Callable[[int, PolicyRun], None] | None = None,
) -> list[PolicyRun]:
    """Run every job, ``processes`` at a time (1: in this process); results in job order.

    ``on_result(index, run)`` is called in this process as each job finishes (a sweep saves
    it, so an interrupted sweep resumes where it stopped).
    """
    from tqdm import tqdm

    total = sum(len(cached_workload(job.options).arrivals) for job in jobs)
    bar = tqdm(total=total, unit="req", disable=not progress or None, file=sys.stderr)
    processes = max(1, min(processes, len(jobs)))
    finished = on_result or (lambda index, run: None)
    try:
        if processes == 1:
            counts = [0] * len(jobs)

            def report(index: int, completed: int) -> None:
                bar.update(completed - counts[index])
                counts[index] = completed

            runs = []
            for index, job in enumerate(jobs):
                runs.append(_run_job(index, job, report))
                finished(index, runs[-1])
            return runs
        context = multiprocessing.get_context("spawn")
        completed = context.Array("q", len(jobs), lock=False)
        with ProcessPoolExecutor(
            processes,
            mp_context=context,
            initializer=_init_worker,
            initargs=(completed, log_interval_s),
        ) as pool:
            futures = [pool.submit(_run_in_worker, i, job) for i, job in enumerate(jobs)]
            index_of = {future: i for i, future in enumerate(futures)}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
                bar.update(sum(completed) - bar.n)
                failed = next((f.exception() for f in done if f.exception()), None)
                if failed is not None:
                    for future in pending:
                        future.cancel()
                    raise failed
                for future in done:
                    finished(index_of[future], future.result())
            return [future.result() for future in futures]
    finally:
        bar.close()
