"""Deliberately wrong variants of balance scheduling; the suite must kill every one.

Each mutant is applied in the pytest process before any test module is imported (see
``pytest_mutant``), by replacing one method of the shared ``BalanceSchedulerMixin`` or its
``BalanceGate`` (every path uses them), of the pause-state hold (``PauseStateHold``), or, for what
only exists in the derived
copy, by changing what ``compat.derive`` splices into the derived ``schedule()`` (its delta
constants and the derived text are read at derivation time, so no hook is needed in ``derive``).
Nothing is written to disk.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    wrong: str  # what the variant does, for the kill table
    paths: tuple[str, ...]  # "shim", "compat", "pause-state": where the variant exists
    apply: Callable[[], None]
    # Test files run for this mutant on top of the shared suite (run.py): where its killer lives.
    files: tuple[str, ...] = ()
    # Whether the installed vLLM has what the mutant changes (None: always); run.py reports a
    # mutant without a target as not applicable instead of running it.
    has_target: Callable[[], bool] | None = None


def _derived():
    """The Phase 2A derivation of the installed vLLM's schedule() (nothing compiled)."""
    import inspect

    import vllm.v1.core.sched.scheduler as scheduler_module

    from vllm_balance.compat import derive

    return derive.derive_source(inspect.getsource(scheduler_module), "installed")


def _mixin():
    from vllm_balance.shim.scheduler import BalanceSchedulerMixin

    return BalanceSchedulerMixin


def _gate():
    from vllm_balance.shim.gather import BalanceGate

    return BalanceGate


def gate_ge_cap_minus_1() -> None:
    from balance_sim.policies import leader_within_one_of_cap  # the simulator's own cap-1

    _gate().leader_at_cap = leader_within_one_of_cap


def gate_wrong_cap() -> None:
    # The token budget instead of the request cap: both are "the scheduler's max".
    mixin = _mixin()
    real_init = mixin.__init__

    def __init__(self, vllm_config, *args, **kwargs):
        real_init(self, vllm_config, *args, **kwargs)
        if self.balance_gate is not None:
            self.balance_gate.token_budget = self.max_num_scheduled_tokens

    mixin.__init__ = __init__
    _gate().leader_at_cap = lambda gate: gate.leader == gate.token_budget


def catch_up_to_leader() -> None:
    mixin = _mixin()

    def schedule(self, throttle_prefills: bool = False):
        gate = self.balance_gate
        if gate is None:
            return super(mixin, self).schedule(throttle_prefills)
        # No freeze; instead the cap is lowered to the leader's count for this step.
        gate.frozen = False
        cap = self.max_num_running_reqs
        self.max_num_running_reqs = min(cap, gate.leader)
        try:
            return super(mixin, self).schedule(throttle_prefills)
        finally:
            self.max_num_running_reqs = cap

    mixin.schedule = schedule


def _stop_condition_at_step_start(scheduler) -> bool:
    """Upstream's WAITING stop condition (0.24: ``==``; 0.25+: ``>=`` incl. streaming waits;
    0.31+ at ``max_num_active_reqs``)."""
    running = len(scheduler.running) + getattr(scheduler, "num_waiting_for_streaming_input", 0)
    return running >= scheduler.balance_gate.cap


def _mutate_derived(name: str, change: Callable[[str], str]) -> None:
    """Compat path: ``change`` the derived ``schedule()`` text (read when it is derived)."""
    from vllm_balance.compat import derive

    real_derive_source = derive.derive_source

    def derive_source(*args, **kwargs):
        derived = real_derive_source(*args, **kwargs)
        source = change(derived.source)
        assert source != derived.source, f"{name}: found nothing to change"
        return dataclasses.replace(derived, source=source)

    derive.derive_source = derive_source


def gate_only_before_loop() -> None:
    """The whole WAITING stop decision taken once when ``schedule()`` starts (docs/testing.md).

    Compat only: on the hold-only seam upstream's slot check stays inline, so the shim cannot
    take that decision at all."""
    mixin = _mixin()

    def schedule(self, throttle_prefills: bool = False):
        gate = self.balance_gate
        if gate is not None:
            gate.frozen = gate.leader_at_cap()
            self._stop_decided_once = _stop_condition_at_step_start(self) or gate.frozen
        return super(mixin, self).schedule(throttle_prefills)

    mixin.schedule = schedule
    # The derived loop tests the same decision instead of upstream's inline check.
    inline_check = re.compile(
        r"^(?P<indent>\s*)if (?:len\(self\.running\) ==|num_running >=) "
        r"self\.max_num_\w+_reqs:$",
        re.MULTILINE,
    )

    def once(source: str) -> str:
        source, count = inline_check.subn(r"\g<indent>if self._stop_decided_once:", source)
        assert count == 1, f"gate_only_before_loop: {count} inline stop checks found"
        return source

    _mutate_derived("gate_only_before_loop", once)


def gate_before_slot_check() -> None:
    """Delta 2 back where it was before the seam became hold-only: the gate right before
    upstream's slot check. A leader at the cap then stops on the gate, so its step no longer
    counts as capacity-bound for vLLM's prefill cadence, as upstream's would."""
    from vllm_balance.compat import derive

    def move(source: str) -> str:
        lines = source.splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if derive.DELTA_GATE[0] in line)
        gate = lines[at : at + len(derive.DELTA_GATE)]
        del lines[at : at + len(derive.DELTA_GATE)]
        lines[at - 2 : at - 2] = gate  # above the slot check's `if` and its `break`
        return "".join(lines)

    _mutate_derived("gate_before_slot_check", move)


def held_step_marks_capacity_bound() -> None:
    """A held step's prefill_capacity_bound kept as upstream records it: the next step vLLM's
    prefill cadence throttles admits anyway (the policy the seam no longer carries)."""
    mixin = _mixin()
    mixin._held_schedule = lambda self, gate, throttle: super(mixin, self).schedule(throttle)


def _pause_state_hold():
    from vllm_balance.compat.pause_state import PauseStateHold

    return PauseStateHold


def pause_not_restored() -> None:
    """Pause-state: a frozen step leaves ``PAUSED_NEW`` set (no restore after upstream's step):
    the next open step admits nothing, and the engine core sees a pause nobody asked for."""
    from vllm.v1.core.sched.interface import PauseState

    hold = _pause_state_hold()
    real = hold._hold_and_schedule

    def _hold_and_schedule(self, throttle_prefills):
        before = self._pause_state
        result = real(self, throttle_prefills)
        if before == PauseState.UNPAUSED:
            self._pause_state = PauseState.PAUSED_NEW
        return result

    hold._hold_and_schedule = _hold_and_schedule


def pause_lowers_operator_pause() -> None:
    """Pause-state: a frozen step under an operator's ``PAUSED_ALL`` runs at ``PAUSED_NEW``
    (the running requests an operator paused are scheduled)."""
    from vllm.v1.core.sched.interface import PauseState

    hold = _pause_state_hold()
    real = hold._hold_and_schedule

    def _hold_and_schedule(self, throttle_prefills):
        operator = self._pause_state
        if operator != PauseState.PAUSED_ALL:
            return real(self, throttle_prefills)
        self._pause_state = PauseState.PAUSED_NEW
        try:
            return real(self, throttle_prefills)
        finally:
            self._pause_state = operator

    hold._hold_and_schedule = _hold_and_schedule


def gate_pins_kv_holders() -> None:
    """Compat: delta 2 without its ``request_queue is self.waiting`` guard where the loop drains
    KV-holders first (0.31+): a frozen step leaves a finished async KV load parked, holding its
    blocks. (On the shim the same bug is the seam's: the neutrality suite's ``kv_holders_held``.)"""
    from vllm_balance.compat import derive

    derive.DELTA_GATE_FRESH = derive.DELTA_GATE


def disabled_allocates_a_buffer() -> None:
    """Balance off, the scheduler still gets a gather buffer of its own (beside a None gate)."""
    import torch

    mixin = _mixin()
    real_init = mixin.__init__

    def __init__(self, vllm_config, *args, **kwargs):
        real_init(self, vllm_config, *args, **kwargs)
        if self.balance_gate is None:
            dp_size = vllm_config.parallel_config.data_parallel_size
            self.balance_buffer = torch.zeros(dp_size, dtype=torch.int32)

    mixin.__init__ = __init__


def disabled_calls_all_gather() -> None:
    import torch
    import torch.distributed as dist

    mixin = _mixin()
    real_follow, real_gather = mixin.follow_dp_group, mixin.balance_gather

    def follow_dp_group(self, group):
        self.__dict__["_mutant_group"] = group
        real_follow(self, group)

    def balance_gather(self):
        group = self.__dict__.get("_mutant_group")
        if self.balance_gate is not None or group is None:
            return real_gather(self)
        dp_size = self.vllm_config.parallel_config.data_parallel_size
        counts = [torch.zeros(1, dtype=torch.int32) for _ in range(dp_size)]
        payload = torch.tensor([len(self.running)], dtype=torch.int32)
        dist.all_gather(counts, payload, group=group)

    mixin.follow_dp_group, mixin.balance_gather = follow_dp_group, balance_gather


def balance_state_shared_between_schedulers() -> None:
    """One gate for every scheduler of the process (a class-level state, as the 19 attributes
    of a mixin could become): two ranks in one process, as the simulator runs them, read and
    count each other's gathers."""
    mixin = _mixin()
    real_gate_class, shared = mixin.gate_class, []

    def shared_gate(options, parallel_config, cap):
        if not shared:
            shared.append(real_gate_class(options, parallel_config, cap))
        return shared[0]

    mixin.gate_class = staticmethod(shared_gate)


def misspelled_key_accepted() -> None:
    """A key of this package that it does not define is read as absent (the defaults)."""
    from vllm_balance import config

    config.refuse_unknown_keys = lambda vllm_config: None


def gather_unbounded_under_fault_tolerance() -> None:
    """Fault tolerance on, the gather keeps gloo's own timeout (30 min): a faulted peer holds
    the healthy ranks outside vLLM's recovery."""
    from vllm_balance.shim import gather

    gather.gather_timeout_under_fault_tolerance = lambda parallel_config: None


def stale_counts_after_same_size_group() -> None:
    """A rebuilt DP group of the same size (a fault-tolerance ``retry``) keeps the counts
    gathered before the fault: the first step after the retry can be frozen on them."""

    def follow_group(self, group):
        if group is not None and group is not self.group:
            if self.group is None or group.size() != self.group.size():
                self._reset(group.size(), group.rank())
        self.group = group

    _gate().follow_group = follow_group


def gather_payload_len_waiting() -> None:

    def balance_gather(self):
        if self.balance_gate is not None:
            self.balance_gate.gather(len(self.waiting))

    _mixin().balance_gather = balance_gather


def gate_reads_stale_buffer() -> None:
    """The gate reads the gather's buffer, not the counts ``set_gathered()`` delivered (which is
    how a simulator or test gathers)."""
    _gate().leader_at_cap = lambda gate: int(gate._buffer.max()) == gate.cap


def engine_core_skips_gather() -> None:
    """``balance_gather()`` deleted from the engine core's hook; the DP group is still injected."""
    from vllm_balance.shim.engine_core import BalanceDPEngineCoreProc

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        result = super(BalanceDPEngineCoreProc, self)._has_global_unfinished_reqs(local_unfinished)
        self.scheduler.follow_dp_group(self.dp_group)
        return result

    BalanceDPEngineCoreProc._has_global_unfinished_reqs = _has_global_unfinished_reqs


def gather_only_on_dp_sync_steps() -> None:
    """The engine core gathers only on the steps where vLLM syncs its DP ranks (a wave's first
    step and every ``dp_sync_interval``-th): the gate decides on counts up to 15 steps old."""
    from vllm_balance.shim.engine_core import BalanceDPEngineCoreProc

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        result = super(BalanceDPEngineCoreProc, self)._has_global_unfinished_reqs(local_unfinished)
        if self.step_counter == 1 or self.step_counter % self.dp_sync_interval == 0:
            self.balance_scheduler.balance_gather()
        return result

    BalanceDPEngineCoreProc._has_global_unfinished_reqs = _has_global_unfinished_reqs


def _syncs_every_dp_sync_interval() -> bool:
    """Whether this vLLM syncs its DP ranks only every ``dp_sync_interval`` steps."""
    from vllm.config import ParallelConfig

    return "dp_sync_interval" in getattr(ParallelConfig, "__dataclass_fields__", {})


def buffer_fixed_at_start_size() -> None:
    """The gather keeps its start-up buffer, rank and size when vLLM swaps in a DP group of
    another size (an elastic-EP resize): the group is used, nothing sized by it."""

    def follow_group(self, group) -> None:
        self.group = group

    _gate().follow_group = follow_group


def keep_paused_rank_gathers_its_running() -> None:
    """A rank paused with ``mode="keep"`` gathers ``len(running)``: its full seats freeze the
    ranks that run for as long as it is paused."""
    from vllm_balance.shim import scheduler

    scheduler.PAUSED_ALL = None  # the gather's pause check never matches


def ray_actor_class_not_chosen() -> None:
    """The API server's decision never swaps in the balance Ray actor (balance silently absent)."""
    from vllm_balance import activation

    def choose_ray_actor_class(vllm_config) -> bool:
        applies = activation.decide(vllm_config).active
        activation.RAY_ACTOR_SWAP.uninstall()
        return applies

    activation.choose_ray_actor_class = choose_ray_actor_class


def ray_actor_skips_activation() -> None:
    """The balance Ray actor runs upstream's ``__init__`` without activating (no scheduler)."""
    from vllm_balance.ray_actor import BalanceDPMoEEngineCoreActor

    def __init__(self, *args, **kwargs) -> None:
        super(BalanceDPMoEEngineCoreActor, self).__init__(*args, **kwargs)

    BalanceDPMoEEngineCoreActor.__init__ = __init__


def pd_refusal_misses_kv_consumer() -> None:
    """The PD-disaggregated refusal checks ``kv_producer`` only (a decode instance slips in)."""
    from vllm_balance import activation

    real_kv_role = activation._kv_role
    activation._kv_role = lambda config: (
        None if real_kv_role(config) == "kv_consumer" else real_kv_role(config)
    )


def ascend_config_not_consulted() -> None:
    """Config source 1 (vllm-ascend's ``AscendConfig``) skipped: additional_config decides."""
    from vllm_balance import config

    config._from_ascend_config = lambda: config._UNSET


def ascend_config_nested_form_ignored() -> None:
    """Only ``AscendConfig.enable_balance_scheduling`` (vllm-ascend <= 0.24's shape) is read;
    newer vllm-ascend's ``AscendConfig.scheduler_config.enable_balance_scheduling`` is missed."""
    from vllm_balance import config

    def from_ascend_config():
        try:
            from vllm_ascend.ascend_config import get_ascend_config
        except ImportError:
            return config._UNSET
        try:
            ascend_config = get_ascend_config()
        except Exception:
            return config._UNSET
        return getattr(ascend_config, config.ENABLE_KEY, config._UNSET)

    config._from_ascend_config = from_ascend_config


def delta3_reverted_to_assert() -> None:
    from vllm_balance.compat import derive

    # Upstream's statement in place of delta 3 (the anchor it replaces).
    derive.DELTA_NO_QUEUE = (derive.QUEUE_ASSERT,)


PD_ROLE_TESTS = (
    "test_pd_disaggregated_is_refused",
    "test_pd_disaggregated_decode_side_kv_consumer_is_refused",
    "test_pd_mixed_kv_both_activates_balance",
)

MUTANTS = {
    m.name: m
    for m in (
        Mutant(
            "gate_ge_cap_minus_1",
            "gate `max >= cap - 1` (shipped once, reverted)",
            ("shim", "compat", "pause-state"),
            gate_ge_cap_minus_1,
        ),
        Mutant(
            "gate_wrong_cap",
            "gate `max == max_num_scheduled_tokens` (token budget, not the request cap)",
            ("shim", "compat", "pause-state"),
            gate_wrong_cap,
        ),
        Mutant(
            "catch_up_to_leader",
            "no freeze; cap lowered to `min(cap, leader)` during schedule()",
            ("shim", "compat", "pause-state"),
            catch_up_to_leader,
        ),
        Mutant(
            "gate_only_before_loop",
            "WAITING stop decision (upstream's cap check + gate) taken once per step",
            ("compat",),
            gate_only_before_loop,
        ),
        Mutant(
            "gate_before_slot_check",
            "Phase 2A delta 2 before upstream's slot check (the leader no longer capacity-bound)",
            ("compat",),
            gate_before_slot_check,
        ),
        Mutant(
            "held_step_marks_capacity_bound",
            "a frozen step updates `prefill_capacity_bound` (lifts vLLM's prefill throttle)",
            ("shim", "compat"),
            held_step_marks_capacity_bound,
        ),
        Mutant(
            "pause_not_restored",
            "pause-state: `PAUSED_NEW` left set after a frozen step",
            ("pause-state",),
            pause_not_restored,
        ),
        Mutant(
            "pause_lowers_operator_pause",
            "pause-state: a frozen step lowers an operator's `PAUSED_ALL` to `PAUSED_NEW`",
            ("pause-state",),
            pause_lowers_operator_pause,
        ),
        Mutant(
            "gate_pins_kv_holders",
            "Phase 2A delta 2 also holds KV-holders (0.31+: a finished KV load stays parked)",
            ("compat",),
            gate_pins_kv_holders,
            has_target=lambda: _derived().holds_fresh_only,
        ),
        Mutant(
            "disabled_allocates_a_buffer",
            "balance off still allocates a gather buffer on the scheduler",
            ("shim", "compat", "pause-state"),
            disabled_allocates_a_buffer,
        ),
        Mutant(
            "disabled_calls_all_gather",
            "balance off still all-gathers when a DP group is injected",
            ("shim", "compat", "pause-state"),
            disabled_calls_all_gather,
        ),
        Mutant(
            "balance_state_shared_between_schedulers",
            "one balance gate shared by every scheduler of the process",
            ("shim", "compat", "pause-state"),
            balance_state_shared_between_schedulers,
        ),
        Mutant(
            "gate_reads_stale_buffer",
            "gate reads the gather's buffer, not the counts `set_gathered()` delivered",
            ("shim", "compat", "pause-state"),
            gate_reads_stale_buffer,
        ),
        Mutant(
            "delta3_reverted_to_assert",
            "Phase 2A delta 3 back to `assert request_queue is not None`",
            ("compat",),
            delta3_reverted_to_assert,
            has_target=lambda: _derived().replaces_queue_assert,
        ),
        Mutant(
            "misspelled_key_accepted",
            "a misspelled `balance_*` key (or enable key) ignored instead of refused",
            ("shim", "compat", "pause-state"),
            misspelled_key_accepted,
            files=("tests/test_config.py",),
        ),
        Mutant(
            "gather_unbounded_under_fault_tolerance",
            "fault tolerance on, the gather keeps gloo's own timeout",
            ("shim", "compat", "pause-state"),
            gather_unbounded_under_fault_tolerance,
            files=("tests/multiproc/test_fault_tolerance.py", "tests/test_dp_shapes.py"),
        ),
        Mutant(
            "stale_counts_after_same_size_group",
            "a rebuilt DP group of the same size (an FT `retry`) keeps the pre-fault counts",
            ("shim", "compat", "pause-state"),
            stale_counts_after_same_size_group,
            files=("tests/multiproc/test_fault_tolerance.py",),
        ),
        Mutant(
            "gather_payload_len_waiting",
            "gather payload `len(self.waiting)`",
            ("shim", "compat", "pause-state"),
            gather_payload_len_waiting,
        ),
        Mutant(
            "engine_core_skips_gather",
            "`balance_gather()` deleted from the engine core's hook (DP group still injected)",
            ("shim", "compat", "pause-state"),
            engine_core_skips_gather,
            files=("tests/multiproc/test_entrypoint.py",),
        ),
        Mutant(
            "gather_only_on_dp_sync_steps",
            "the engine core gathers only on vLLM's DP-sync steps (every `dp_sync_interval`)",
            ("shim", "compat", "pause-state"),
            gather_only_on_dp_sync_steps,
            has_target=_syncs_every_dp_sync_interval,
        ),
        Mutant(
            "buffer_fixed_at_start_size",
            "gather buffer, rank and size kept at start-up when vLLM resizes the DP group",
            ("shim", "compat", "pause-state"),
            buffer_fixed_at_start_size,
            files=("tests/multiproc/test_resize.py",),
        ),
        Mutant(
            "keep_paused_rank_gathers_its_running",
            'a rank paused with `mode="keep"` gathers `len(running)`, not 0',
            ("shim", "compat", "pause-state"),
            keep_paused_rank_gathers_its_running,
            files=(
                "tests/multiproc/test_pause.py::"
                "test_keep_paused_rank_at_the_cap_does_not_freeze_the_other_rank",
            ),
        ),
        Mutant(
            "ray_actor_class_not_chosen",
            "Ray backend: the API server keeps vLLM's `DPMoEEngineCoreActor` with balance on",
            ("shim", "compat", "pause-state"),
            ray_actor_class_not_chosen,
            files=("tests/test_ray_actor.py",),
        ),
        Mutant(
            "ray_actor_skips_activation",
            "Ray backend: the balance actor does not activate in its `__init__`",
            ("shim", "compat", "pause-state"),
            ray_actor_skips_activation,
            files=("tests/test_ray_actor.py",),
        ),
        Mutant(
            "pd_refusal_misses_kv_consumer",
            "PD refusal checks `kv_producer` only; `kv_consumer` activates balance",
            ("shim", "compat", "pause-state"),
            pd_refusal_misses_kv_consumer,
            # The PD tests only: the rest of the file starts interpreters (minutes on 2 cores).
            files=tuple(f"tests/test_activation.py::{test}" for test in PD_ROLE_TESTS),
        ),
        Mutant(
            "ascend_config_not_consulted",
            "config source 1 (vllm-ascend's `AscendConfig`) skipped",
            ("shim", "compat", "pause-state"),
            ascend_config_not_consulted,
            files=("tests/test_config.py",),
        ),
        Mutant(
            "ascend_config_nested_form_ignored",
            "`AscendConfig.scheduler_config.enable_balance_scheduling` (nested form) not read",
            ("shim", "compat", "pause-state"),
            ascend_config_nested_form_ignored,
            files=("tests/test_config.py",),
        ),
    )
}


_applied: list[str] = []


def apply(name: str) -> None:
    """Apply mutant ``name`` (``"none"``: the baseline) before anything imports compat's class.

    Also called by ``tests/multiproc/entrypoint.py``, a separate interpreter whose engine
    processes vLLM forks from it; applying twice in one process is refused.
    """
    if name == "none":
        return
    assert not _applied, f"mutant {_applied[0]} already applied"
    _applied.append(name)
    # The compat mutants change what derive splices; the derived class must not exist yet.
    assert "vllm_balance.compat.scheduler" not in sys.modules, "mutant applied too late"
    MUTANTS[name].apply()
