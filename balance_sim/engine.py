"""N DP ranks in one process, advanced in lockstep like ``DPEngineCoreProc.run_busy_loop``.

One iteration of :meth:`Cluster.step` is one engine step on every rank:

1. requests that arrived by now are routed and added (``add_request``), as the engine's input
   queue delivers them before ``step()``;
2. the policy makes its cluster-wide decisions (throttle flag, hold);
3. each rank with requests calls its real ``schedule()``; a rank without requests runs a dummy
   batch (it still joins the MoE collectives);
4. the step lasts as long as the slowest rank, plus the cluster-shared expert work
   (:mod:`.stepmodel`);
5. each rank feeds a fabricated forward result to its real ``update_from_output()``;
6. the gather: every rank's gate receives all ranks' ``len(running)``
   (``balance_gate.set_gathered()``, the gather's own second half), exactly the vector the
   engine core's ``all_gather`` would deliver after this step, consumed at the next
   ``schedule()``. The gather's own time (``gather_ms``) delays the next step.

When every rank is idle the cluster skips ahead to the next arrival without a step (and without
a gather, contract 3), and a new wave starts (vLLM resets ``step_counter``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from balance_sim.builders import (
    RequestSpec,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_runner_output,
    prompt_token_ids,
)
from balance_sim.policies import Policy
from balance_sim.router import Counts
from balance_sim.stepmodel import RankWork, StepTimeModel
from balance_sim.workload import Arrival


@dataclass(frozen=True)
class ClusterConfig:
    dp_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_gpu_blocks: int


@dataclass
class RequestRecord:
    rank: int
    arrival_s: float
    output_len: int
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens: int = 0
    finished: bool = False


@dataclass
class StepLog:
    """One entry per lockstep step (per rank where it says so)."""

    time_s: list[float] = field(default_factory=list)  # end of the step
    running: list[list[int]] = field(default_factory=list)  # per rank, after the step
    gate_input: list[list[int]] = field(default_factory=list)  # the vector each step's gate read
    admitted: list[list[int]] = field(default_factory=list)  # per rank, new + resumed
    held: list[bool] = field(default_factory=list)


@dataclass
class RunRecord:
    """What one policy run leaves behind, as plain data: it crosses process boundaries.

    ``balance_stats`` holds each rank's product counters (``BalanceStats``) when the ranks ran
    the product's class with balance enabled, else it is empty.
    """

    policy: str
    config: ClusterConfig
    now_s: float
    requests: dict[str, RequestRecord]
    log: StepLog
    balance_stats: list[Any]


def _rank_work(scheduler: Any, output: Any) -> RankWork:
    """What one rank's forward does for what ``schedule()`` returned (a dummy batch: nothing)."""
    if output is None:
        return RankWork()
    prefill_tokens = decode_requests = kv_tokens = 0
    for req_id, num_tokens in output.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        # schedule() already advanced num_computed_tokens by this step's tokens.
        if request.num_computed_tokens - num_tokens < request.num_prompt_tokens:
            prefill_tokens += num_tokens
        else:
            decode_requests += 1
            kv_tokens += request.num_computed_tokens
    return RankWork(prefill_tokens, decode_requests, kv_tokens)


def _rank_config(vllm_config: Any, rank: int) -> Any:
    """A copy of the cluster's config for one DP rank (its log lines say which rank)."""
    rank_config = copy.deepcopy(vllm_config)
    rank_config.parallel_config.data_parallel_rank = rank
    return rank_config


def _admitted(output: Any) -> int:
    return len(output.scheduled_new_reqs) + len(
        getattr(output.scheduled_cached_reqs, "resumed_req_ids", ())
    )


class Cluster:
    def __init__(
        self,
        config: ClusterConfig,
        policy: Policy,
        router: Any,
        step_model: StepTimeModel,
        arrivals: Sequence[Arrival],
    ) -> None:
        self.config = config
        self.policy = policy
        self.router = router
        self.step_model = step_model
        self.arrivals = arrivals
        vllm_config = make_vllm_config(
            moe=True,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            num_gpu_blocks=config.num_gpu_blocks,
            data_parallel_size=config.dp_size,
            additional_config=policy.additional_config(),
        )
        cls = policy.scheduler_class()
        self.schedulers = [
            make_scheduler(cls, _rank_config(vllm_config, rank)) for rank in range(config.dp_size)
        ]
        self.now_s = 0.0
        self.next_arrival = 0
        self.step_in_wave = 0
        self.requests: dict[str, RequestRecord] = {}
        self.completed = 0
        self.log = StepLog()

    # -- state --------------------------------------------------------------------------------
    def request_counts(self) -> Counts:
        return [s.get_request_counts()[::-1] for s in self.schedulers]  # (waiting, running)

    def running_counts(self) -> list[int]:
        return [len(s.running) for s in self.schedulers]

    def busy(self) -> bool:
        return any(s.has_requests() for s in self.schedulers)

    def done(self) -> bool:
        return self.next_arrival >= len(self.arrivals) and not self.busy()

    # -- one step -----------------------------------------------------------------------------
    def _deliver_arrivals(self) -> None:
        while (
            self.next_arrival < len(self.arrivals)
            and self.arrivals[self.next_arrival].time_s <= self.now_s
        ):
            arrival = self.arrivals[self.next_arrival]
            rank = self.router.route(self.request_counts)
            spec = RequestSpec(
                request_id=f"req-{arrival.index}",
                prompt_token_ids=prompt_token_ids(arrival.index, arrival.prompt_len),
                max_tokens=arrival.output_len,
                arrival_time=arrival.time_s,
            )
            self.schedulers[rank].add_request(make_request(spec))
            self.requests[spec.request_id] = RequestRecord(rank, arrival.time_s, arrival.output_len)
            self.next_arrival += 1

    def _skip_idle_gap(self) -> None:
        if not self.busy() and self.next_arrival < len(self.arrivals):
            self.now_s = max(self.now_s, self.arrivals[self.next_arrival].time_s)
            self.step_in_wave = 0  # vLLM starts a new wave and resets step_counter

    def gather(self) -> list[int]:
        """What ``balance_gather()``'s all_gather delivers to every rank after this step."""
        counts = self.running_counts()
        if self.policy.balance:
            # The collective itself takes time; the next step starts after it (contract 3).
            self.now_s += self.step_model.gather_cost_ms(self.config.dp_size) / 1000.0
            for scheduler in self.schedulers:
                scheduler.balance_gate.set_gathered(counts)
        return counts

    def _record_tokens(self, engine_outputs: dict) -> None:
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                record = self.requests[out.request_id]
                if out.new_token_ids:
                    if record.first_token_s is None:
                        record.first_token_s = self.now_s
                    record.last_token_s = self.now_s
                    record.tokens += len(out.new_token_ids)
                if out.finish_reason is not None:
                    record.finished = True
                    self.completed += 1

    def step(self) -> None:
        self._skip_idle_gap()
        self._deliver_arrivals()
        # Empty before the first gather (the gate reads zeros) and with balance off.
        gate = self.schedulers[0].balance_gate if self.policy.balance else None
        gate_input = [] if gate is None else list(gate.stats.last_gathered)
        throttle = self.policy.before_schedule(self.schedulers, self.step_in_wave)
        outputs = [s.schedule(throttle) if s.has_requests() else None for s in self.schedulers]
        active = [s for s, out in zip(self.schedulers, outputs) if out is not None]
        held = self.policy.held(active, throttle)
        works = [_rank_work(s, o) for s, o in zip(self.schedulers, outputs)]
        self.now_s += self.step_model.step_time_ms(works) / 1000.0
        for scheduler, output in zip(self.schedulers, outputs):
            if output is not None:
                runner_output = model_runner_output(output, scheduler)
                self._record_tokens(scheduler.update_from_output(output, runner_output))
        counts = self.gather()
        self.step_in_wave += 1
        self.router.publish(self.now_s, self.request_counts())
        self.log.time_s.append(self.now_s)
        self.log.running.append(counts)
        self.log.gate_input.append(gate_input)
        self.log.admitted.append([_admitted(o) if o is not None else 0 for o in outputs])
        self.log.held.append(held)

    def record(self) -> RunRecord:
        gates = [getattr(s, "balance_gate", None) for s in self.schedulers]
        stats = [gate.stats for gate in gates if gate is not None]
        return RunRecord(self.policy.name, self.config, self.now_s, self.requests, self.log, stats)

    def run(self, on_step: Callable[[Cluster], None] | None = None, max_steps: int = 10**7):
        steps = 0
        while not self.done():
            self.step()
            steps += 1
            if on_step is not None:
                on_step(self)
            if steps >= max_steps:
                raise RuntimeError(f"policy {self.policy.name}: not drained in {max_steps} steps")
        return self
