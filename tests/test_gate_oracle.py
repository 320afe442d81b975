"""Contracts 1 and 3 on generated workloads: the gate cuts admission exactly where the contract
says, compared step by step with an upstream Scheduler cut by construction (``GateOracle``).

Scripted gathered vectors per step: leader at the cap, at cap-1, several ranks at the cap, all
zero, DP sizes 2..256. ``oracle_queue`` sets them with ``balance_gate.set_gathered()`` (the
gather's second half); ``oracle_gather`` delivers the vector through the real
``balance_gather()`` with the other ranks scripted, so this rank's slot is its own payload
(contract 3: ``len(running)``, once per step).
"""

from __future__ import annotations

from balance_differential import check_property

from balance_testbed.lockstep import Gathered, Req, Workload

# The oracle must have cut admission on real frozen steps, and admitted on open ones.
ORACLE_REACHES = {"frozen_with_room_and_waiting", "admitted", "preemption", "skipped_waiting"}


def scripted(dp_size: int, *shapes: Gathered, cap: int = 2) -> Workload:
    """Eight short requests arriving over four steps, under a vector script that cycles."""
    return Workload(
        cap=cap,
        max_num_batched_tokens=2048,
        long_prefill_token_threshold=0,
        num_gpu_blocks=1000,
        enable_prefix_caching=False,
        dp_size=dp_size,
        requests=tuple(
            Req(index=i, prefix=0, tail=8 + i, max_tokens=3 + i % 4, arrive=i // 2)
            for i in range(8)
        ),
        aborts=(),
        gathered=shapes,
    )


# Named vectors (cap 2): leader at cap, at cap-1, several at cap, all zero; DP 2 and 256.
AT_CAP, SEVERAL_AT_CAP = Gathered(top=2, n_top=1, rest=0), Gathered(top=2, n_top=5, rest=1)
AT_CAP_MINUS_ONE, ALL_ZERO = Gathered(top=1, n_top=1, rest=0), Gathered(top=0, n_top=1, rest=0)
# KV pressure under a cycling script (cap 4, DP 8): preemption and resumption around frozen steps.
PREEMPTING = Workload(
    cap=4,
    max_num_batched_tokens=2048,
    long_prefill_token_threshold=0,
    num_gpu_blocks=16,
    enable_prefix_caching=False,
    dp_size=8,
    requests=tuple(
        Req(index=i, prefix=0, tail=40 + 5 * i, max_tokens=24, arrive=i // 2) for i in range(6)
    ),
    aborts=(),
    gathered=(Gathered(top=4, n_top=3, rest=1), ALL_ZERO, Gathered(top=3, n_top=1, rest=0)),
)
NAMED = [
    scripted(2, AT_CAP, AT_CAP_MINUS_ONE),
    scripted(256, SEVERAL_AT_CAP, ALL_ZERO, AT_CAP_MINUS_ONE),
    scripted(2, ALL_ZERO),
    scripted(256, AT_CAP),  # held at the cap throughout: nothing is ever admitted
    PREEMPTING,
]


def test_contract1_gate_freezes_exactly_when_the_leader_equals_the_cap():
    reached = check_property("oracle_queue", at_cap=True, max_examples=120, examples=NAMED)
    assert ORACLE_REACHES <= set(reached), f"never reached: {ORACLE_REACHES - set(reached)}"


def test_contract3_gate_fed_by_balance_gather_payload_len_running_once_per_step():
    reached = check_property("oracle_gather", at_cap=True, max_examples=80, examples=NAMED)
    assert ORACLE_REACHES <= set(reached), f"never reached: {ORACLE_REACHES - set(reached)}"
