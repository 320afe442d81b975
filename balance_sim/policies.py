"""Admission policies compared by the simulator. They live here only, never in the product.

Every policy runs real vLLM schedulers of the installed pin:

- ``off``: upstream ``Scheduler``, balance disabled (what vLLM does today);
- ``on``: ``vllm_balance.BalanceScheduler`` with balance enabled, the contract (``==`` cap);
- ``cap-1``: the product's class with the gate widened to ``max >= cap - 1``, the variant
  vllm-ascend shipped once and reverted for a TTFT regression (kept here to measure it);
- ``vllm-cadence[:N]``: upstream ``Scheduler`` driven with ``schedule(throttle_prefills=...)`` the
  way vLLM's ``DPEngineCoreProc._should_throttle_prefills`` drives it (throttled unless
  ``step_counter % N == 0``; the counter restarts at every wave), N = 2 by default;
- ``trtllm-adp[:TIMEOUT[:WAIT]]``: TensorRT-LLM's attention-DP balance, see
  :class:`TrtllmAdpBalance`;
- ``bounded-hold:K``: the product's opt-in bounded hold (``balance_max_frozen_steps: K``):
  the gate, but after K consecutive frozen steps admission opens for one step on all ranks.

Variants of the gate are small subclasses of the product's ``BalanceGate`` that override only
``leader_at_cap()``, the once-per-step decision the scheduler's ``schedule()`` consumes, set as
its ``gate_class``; everything else, including the WAITING loop the gate stops, is the installed
vLLM's own code.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

DEFAULT_POLICIES = ("off", "on", "cap-1", "vllm-cadence:2", "trtllm-adp:50:10")


def balance_scheduler_class() -> type:
    """The product's balance class for the installed vLLM (shim or compat path)."""
    import vllm_balance

    cls = vllm_balance.BalanceScheduler
    # The variants below replace its gate_class; refuse a class that would silently ignore it.
    if not callable(getattr(getattr(cls, "gate_class", None), "leader_at_cap", None)):
        raise RuntimeError(f"{cls.__qualname__} has no gate_class; the sim cannot vary its gate")
    return cls


def leader_within_one_of_cap(gate: Any) -> bool:
    """The reverted ``cap-1`` gate, as a ``leader_at_cap()``: freeze when the leader is within one
    request of the cap (``max >= cap - 1`` instead of the contract's ``==``).

    Written once: the simulator's ``cap-1`` policy and the bench-serve server's scheduler class
    (:func:`cap_minus_one_class`), the mutation run's ``gate_ge_cap_minus_1`` and the differential
    test's readable-divergence control all install this function, so the variant they measure is
    the one the suite must catch.
    """
    return gate.leader >= gate.cap - 1


def _with_gate(name: str, leader_at_cap: Any) -> type:
    """The product's balance class with a gate whose ``leader_at_cap`` is ``leader_at_cap``."""
    base = balance_scheduler_class()
    gate = type(f"{name}Gate", (base.gate_class,), {"leader_at_cap": leader_at_cap})
    return type(f"{name}Scheduler", (base,), {"gate_class": gate})


@functools.cache
def cap_minus_one_class() -> type:
    """Reverted variant: freeze when the leader is within one request of the cap."""
    return _with_gate("CapMinusOne", leader_within_one_of_cap)


@functools.cache
def held_admission_class() -> type:
    """The gate driven by a cluster-wide decision the simulator sets before each step
    (``sim_hold`` on each rank's gate)."""
    return _with_gate("HeldAdmission", lambda gate: getattr(gate, "sim_hold", False))


def upstream_scheduler_class() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


class Policy:
    """One admission policy: which scheduler class each rank runs and what the cluster adds."""

    name: str = ""
    balance: bool = False  # enable_balance_scheduling in the ranks' config
    # Seconds between the product's per-rank log lines (balance_log_interval_s); 0 = off.
    log_interval_s: float = 0.0

    def additional_config(self) -> dict | None:
        """The ranks' ``additional_config``: how an operator would configure this policy."""
        from vllm_balance.config import ENABLE_KEY, LOG_INTERVAL_KEY

        if not self.balance:
            return None
        return {ENABLE_KEY: True, LOG_INTERVAL_KEY: self.log_interval_s}

    def scheduler_class(self) -> type:
        return upstream_scheduler_class()

    def before_schedule(self, schedulers: Sequence[Any], step_in_wave: int) -> bool:
        """Cluster-wide decisions for the coming step; returns ``throttle_prefills``."""
        return False

    def held(self, schedulers: Sequence[Any], throttled: bool) -> bool:
        """Whether admission was held on this step (the "frozen" column)."""
        if not self.balance:
            return False
        return any(s.balance_gate.frozen for s in schedulers)


class OffPolicy(Policy):
    name = "off"


class ContractPolicy(Policy):
    name = "on"
    balance = True

    def scheduler_class(self) -> type:
        return balance_scheduler_class()


class CapMinusOnePolicy(ContractPolicy):
    name = "cap-1"

    def scheduler_class(self) -> type:
        return cap_minus_one_class()


class BoundedHoldPolicy(ContractPolicy):
    def __init__(self, max_frozen_steps: int) -> None:
        self.max_frozen_steps = max_frozen_steps
        self.name = f"bounded-hold:{max_frozen_steps}"

    def additional_config(self) -> dict | None:
        from vllm_balance.config import MAX_FROZEN_STEPS_KEY

        return {**super().additional_config(), MAX_FROZEN_STEPS_KEY: self.max_frozen_steps}


class VllmCadencePolicy(Policy):
    """vLLM's DP prefill cadence (``--prefill-schedule-interval``, vLLM default 1 = off)."""

    def __init__(self, interval: int = 2) -> None:
        self.interval = interval
        self.name = f"vllm-cadence:{interval}"

    def before_schedule(self, schedulers: Sequence[Any], step_in_wave: int) -> bool:
        # Same expression as DPEngineCoreProc._should_throttle_prefills (vLLM 0.24/0.25).
        return self.interval > 1 and step_in_wave % self.interval != 0

    def held(self, schedulers: Sequence[Any], throttled: bool) -> bool:
        return throttled


class TrtllmAdpBalance(Policy):
    """TensorRT-LLM's attention-DP balance, as a cluster-wide admission hold.

    Source: TensorRT-LLM ``tensorrt_llm/_torch/pyexecutor/py_executor.py``,
    ``PyExecutor._balance_adp_requests``, configured by ``AttentionDpConfig(enable_balance,
    timeout_iters=50, batching_wait_iters=10)`` in ``tensorrt_llm/llmapi/llm_args.py`` (the
    ``attention_dp_config`` LLM argument; TensorRT-LLM's tech blog "ADP Balance Strategy"
    explains it). Each iteration every rank all-gathers its number of scheduled context and
    generation requests, then:

    - if every rank has a context request and a free slot: release; but when every rank also
      has generation requests, first wait up to ``batching_wait_iters`` iterations so more
      context requests batch together;
    - otherwise hold new context requests, and release after ``timeout_iters`` held iterations,
      or at once when some rank has no generation request (nothing to keep busy).

    Mapped onto vLLM: "has a context request" = WAITING is non-empty and the rank is below
    ``max_num_seqs``; "generation requests" = ``len(running)``; a hold stops admission through
    the product's gate (``leader_at_cap()`` returns the decision). TensorRT-LLM gathers these
    counts within the step; the simulator reads them from all ranks at the same point.
    """

    balance = True

    def __init__(self, timeout_iters: int = 50, batching_wait_iters: int = 10) -> None:
        self.timeout_iters = timeout_iters
        self.batching_wait_iters = batching_wait_iters
        self.name = f"trtllm-adp:{timeout_iters}:{batching_wait_iters}"
        self.waiting_iters = 0
        self.batching_iters = 0

    def scheduler_class(self) -> type:
        return held_admission_class()

    def _hold(self, schedulers: Sequence[Any]) -> bool:
        cap = schedulers[0].max_num_running_reqs
        num_gen = [len(s.running) for s in schedulers]
        # Upstream's own waiting count: its queues differ between releases (0.31 dropped
        # skipped_waiting, added kv_holding_waiting).
        has_ctx = [bool(s.get_request_counts()[1]) and len(s.running) < cap for s in schedulers]
        all_free = all(n < cap for n in num_gen)
        all_gen = all(n > 0 for n in num_gen)
        if all_free and all(has_ctx):
            self.waiting_iters = 0
            if all_gen and self.batching_iters < self.batching_wait_iters:
                self.batching_iters += 1
                return True
            self.batching_iters = 0
            return False
        self.waiting_iters += 1
        if self.waiting_iters >= self.timeout_iters or not all_gen:
            self.waiting_iters = 0
            return False
        return True

    def before_schedule(self, schedulers: Sequence[Any], step_in_wave: int) -> bool:
        hold = self._hold(schedulers)
        for scheduler in schedulers:
            scheduler.balance_gate.sim_hold = hold
        return False


def make_policy(spec: str) -> Policy:
    """A fresh policy (with fresh counters) from ``name[:param[:param]]``."""
    name, *raw = spec.split(":")
    try:
        params = [int(p) for p in raw]
    except ValueError as exc:
        raise ValueError(f"policy {spec!r}: parameters must be integers") from exc
    simple = {"off": OffPolicy, "on": ContractPolicy, "cap-1": CapMinusOnePolicy}
    if name in simple and not params:
        return simple[name]()
    if name == "vllm-cadence" and len(params) <= 1:
        return VllmCadencePolicy(*params)
    if name == "trtllm-adp" and len(params) <= 2:
        return TrtllmAdpBalance(*params)
    if name == "bounded-hold" and len(params) == 1:
        return BoundedHoldPolicy(params[0])
    raise ValueError(
        f"policy {spec!r}: expected off, on, cap-1, vllm-cadence[:N], "
        "trtllm-adp[:TIMEOUT[:WAIT]] or bounded-hold:K"
    )
