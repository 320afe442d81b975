"""Contract 2 and 4 on generated workloads: BalanceScheduler == upstream Scheduler, step by step.

The engine is in ``lockstep``, the sides and the workload strategies in ``balance_differential``;
this file states the properties and checks that the generated workloads really reach the paths
the claim covers (a property that never preempts proves nothing about preemption).
"""

from __future__ import annotations

import pytest
from balance_differential import check_property, compare, property_settings, workloads
from hypothesis import Phase, given, settings

import vllm_balance
from balance_sim.policies import leader_within_one_of_cap
from balance_testbed.factories import Divergence
from balance_testbed.lockstep import Gathered, Req, Workload

# Paths a gate-open run must reach somewhere in the generated examples.
GATE_OPEN_REACHES = {
    "preemption",
    "resumption",
    "prefix_cache_hit",
    "chunked_prefill",
    "skipped_waiting",
    "cap_reached_with_waiting",
    "abort",
    "admitted",
}

# Leader at cap-1 on 2 of 256 ranks, every step: the vector closest to the cap that stays open.
CAP_MINUS_ONE_EVERYWHERE = Workload(
    cap=3,
    max_num_batched_tokens=64,
    long_prefill_token_threshold=24,
    num_gpu_blocks=20,
    enable_prefix_caching=True,
    dp_size=256,
    requests=tuple(
        Req(index=i, prefix=i % 3, tail=30 + 9 * i, max_tokens=6 + i, arrive=i // 2)
        for i in range(7)
    )
    + (Req(index=7, prefix=1, tail=5, max_tokens=3, arrive=1, grammar_ready=4),),
    aborts=((3, 4),),
    gathered=(Gathered(top=2, n_top=2, rest=0),),
)


def test_contract2_gate_open_outputs_and_queues_equal_upstream_on_generated_workloads():
    reached = check_property(
        "gate_open", at_cap=False, max_examples=120, examples=(CAP_MINUS_ONE_EVERYWHERE,)
    )
    assert GATE_OPEN_REACHES <= set(reached), f"never reached: {GATE_OPEN_REACHES - set(reached)}"


def test_contract4_disabled_equals_upstream_allocates_nothing_never_gathers():
    reached = check_property("disabled", at_cap=True, max_examples=30)
    # The scripted vector held the cap on steps where upstream admitted, and ours (equal to
    # upstream on every step) admitted too: a gate acting with balance off would diverge.
    assert "admitted_with_cap_in_vector" in reached, reached


def test_a_divergence_reports_the_minimal_workload_and_first_differing_field(monkeypatch):
    # The shipped-and-reverted cap-1 gate, pointed at the gate-open property: it must fail,
    # and the report must be readable: the shrunk workload and the first differing field path.
    monkeypatch.setattr(
        vllm_balance.BalanceScheduler.gate_class, "leader_at_cap", leader_within_one_of_cap
    )

    @settings(property_settings(max_examples=60), phases=[Phase.generate, Phase.shrink])
    @given(workload=workloads(at_cap=False))
    def gate_open_is_upstream(workload):
        compare(workload, "gate_open")

    with pytest.raises(Divergence) as caught:
        gate_open_is_upstream()
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "minimal workload: Workload(cap=" in notes
    assert "gathered vector" in notes
    # e.g. "step 0: output.num_scheduled_tokens.r0: present on one side only"
    assert caught.value.args[0].startswith("step 0: output."), caught.value.args[0]
    # Shrinking gives a small case: a handful of requests, not the generated dozens.
    assert notes.count("max_tokens=") <= 3, notes
