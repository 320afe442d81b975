"""The per-run invariants every completed multiproc trace must satisfy (``check_trace``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.multiproc.events import TraceResult


# ---------------------------------------------------------------- per-run invariants
@dataclass
class TraceSummary:
    gathers: int
    frozen_steps: int
    schedule_steps: int
    forwards: dict[int, int] = field(default_factory=dict)


def check_trace(result: TraceResult, balance: bool = True) -> TraceSummary:
    """Assert the per-run invariants of one completed trace; return counts for reporting.

    1. every request finished with its expected token count (aborted: never more than asked);
    2. every rank did the same number of gathers, and gather k returned the same vector on every
       rank (so every rank's gate decision for the next step is the same);
    3. one gather per active step: on each rank, gathers == forwards (model or dummy);
    4. the gate decision each rank took is the contract's: frozen <=> max(gathered) == cap, no
       admission while frozen, and admission while open when a WAITING request fits;
    5. one schedule record per engine step: on each rank, the schedule() calls that scheduled
       tokens equal the model forwards (a record per nested call would count a step twice).
    """
    name = result.trace.name
    for request_id, state in result.requests.items():
        if state.aborted:
            assert state.tokens <= state.max_tokens, (name, request_id, state)
            continue
        assert state.finish_reason is not None, (name, request_id, "unfinished", state)
        assert str(state.finish_reason).lower().endswith("length"), (name, request_id, state)
        assert state.tokens == state.max_tokens, (name, request_id, state)

    per_rank_gathers = {
        rank: [fields["queue"] for kind, fields in records if kind == "gather"]
        for rank, records in result.records.items()
    }
    counts = {rank: len(g) for rank, g in per_rank_gathers.items()}
    assert len(set(counts.values())) == 1, (name, "gather counts differ", counts)
    vectors = list(per_rank_gathers.values())
    for k, gathered in enumerate(zip(*vectors, strict=True)):
        assert all(v == gathered[0] for v in gathered), (name, f"gather {k} differs", gathered)
    gathers = next(iter(counts.values()))
    if not balance:
        assert gathers == 0, (name, "baseline gathered", counts)

    forwards = {}
    frozen_steps = schedule_steps = 0
    for rank, records in result.records.items():
        forwards[rank] = sum(1 for kind, _ in records if kind in ("exec", "dummy"))
        if balance:
            assert forwards[rank] == counts[rank], (name, rank, "gathers != forwards", forwards)
        model_forwards = sum(1 for kind, _ in records if kind == "exec")
        busy_schedules = sum(1 for kind, f in records if kind == "schedule" and f["tokens"])
        assert busy_schedules == model_forwards, (name, rank, busy_schedules, model_forwards)
        last_gather = None
        for kind, fields in records:
            if kind == "gather":
                last_gather = fields["queue"]
                continue
            if kind != "schedule" or not balance:
                continue
            schedule_steps += 1
            queue = fields["queue"]
            # The gate reads exactly what the last gather wrote (zeros before the first one).
            assert queue == (last_gather or [0] * len(queue)), (name, rank, queue, last_gather)
            frozen = max(queue) == fields["cap"]
            if fields["frozen"] is not None:
                assert fields["frozen"] == frozen, (name, rank, "gate decision", fields)
            if frozen:
                frozen_steps += 1
                assert fields["admitted"] == 0, (name, rank, "admitted while frozen", fields)
            elif (
                fields["waiting"] and fields["running"] < fields["cap"] and not fields.get("paused")
            ):
                admitted = fields["admitted"] + fields.get("resumed", 0)
                assert admitted > 0, (name, rank, "open gate did not admit", fields)
    return TraceSummary(gathers, frozen_steps, schedule_steps, forwards)
