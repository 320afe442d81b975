"""Scripted request traces for the multi-process harness (fixed set and randomized soak).

Every trace goes through the real input queue of each rank (ADD / ABORT / START_DP_WAVE frames)
and ends with the DP wave complete. The cluster's cap (``max_num_seqs``) is ``CAP``: traces that
put more than ``CAP`` requests on one rank drive the leader to the cap, so the gate freezes
admission on every rank for some steps.
"""

from __future__ import annotations

import random

from tests.multiproc.events import (
    Abort,
    Add,
    DelayWaveStart,
    Event,
    Sleep,
    Trace,
    WaitTokens,
    WaitWaveEnd,
)

CAP = 4
# The DP sizes the fixed set and the soak spread their traces over.
DP_SIZES = (2, 3, 4)


def _ids(prefix: str):
    n = 0
    while True:
        n += 1
        yield f"{prefix}-{n}"


def drain_early(dp: int) -> Trace:
    """Rank 0 decodes long; every other rank finishes after a few tokens and runs dummy batches.

    Designated trace for lesson A (gather inside ``schedule()``): the drained ranks stop
    entering ``schedule()`` while rank 0 keeps calling it.
    """
    events: list[Event] = [Add(0, "long-a", 16, 24), Add(0, "long-b", 24, 20)]
    events += [Add(r, f"short-{r}", 8, 2) for r in range(1, dp)]
    return Trace(f"drain_early-dp{dp}", dp, events)


def late_wave_start(dp: int) -> Trace:
    """Work reaches rank 0 first; START_DP_WAVE reaches the others 0.3 s later (late input).

    Designated trace for lesson B (gather inside ``_process_engine_step()``): rank 0 is blocked
    in its forward's collective while the others sit in ``_process_input_queue()``; when they
    wake they have nothing to run, so they reach the gather before their dummy forward.
    Repeated for a second wave that starts on the last rank.
    """
    last = dp - 1
    events: list[Event] = [
        DelayWaveStart(0.3),
        Add(0, "w0-a", 12, 6),
        WaitWaveEnd(),
        DelayWaveStart(0.3),
        Add(last, "w1-a", 12, 6),
    ]
    return Trace(f"late_wave_start-dp{dp}", dp, events)


def staggered(dp: int) -> Trace:
    ids = _ids("stag")
    events: list[Event] = []
    for step in range(3):
        for r in range(dp):
            events.append(Add((r + step) % dp, next(ids), 8 + 8 * r, 3 + 2 * step))
            events.append(Sleep(0.02))
    return Trace(f"staggered-dp{dp}", dp, events)


def one_rank_idle(dp: int) -> Trace:
    """The last rank never receives a request: it only runs dummy batches."""
    events: list[Event] = []
    for r in range(dp - 1):
        events += [Add(r, f"busy-{r}-{i}", 10 + 3 * i, 4 + i) for i in range(3)]
    return Trace(f"one_rank_idle-dp{dp}", dp, events)


def saturate_cap(dp: int) -> Trace:
    """Rank 0 gets 2x the cap: it sits at the cap, so nobody admits until it frees a slot."""
    events: list[Event] = [Add(0, f"sat-{i}", 8, 6 + i) for i in range(2 * CAP)]
    events.append(WaitTokens("sat-0", 1))
    for r in range(1, dp):
        events += [Add(r, f"other-{r}-{i}", 8, 3) for i in range(CAP - 1)]
    return Trace(f"saturate_cap-dp{dp}", dp, events)


def waves(dp: int) -> Trace:
    """Three waves, each started by a different rank (START_DP_WAVE wakes the others)."""
    events: list[Event] = []
    for w in range(3):
        starter = w % dp
        events += [Add(starter, f"wave{w}-{i}", 8, 3 + i) for i in range(2)]
        events.append(WaitWaveEnd())
    return Trace(f"waves-dp{dp}", dp, events[:-1])


def aborts(dp: int) -> Trace:
    """Abort a decoding request mid-flight and one still WAITING behind the gate."""
    events: list[Event] = [Add(0, f"ab-run-{i}", 8, 30) for i in range(CAP)]
    events += [Add(0, "ab-queued", 8, 5)]
    events += [Add(r, f"ab-other-{r}", 8, 6) for r in range(1, dp)]
    events += [WaitTokens("ab-run-0", 3), Abort(0, ("ab-run-0", "ab-queued"))]
    events += [WaitTokens("ab-run-1", 5), Abort(0, ("ab-run-1",))]
    return Trace(f"aborts-dp{dp}", dp, events)


def restart_after_drain(dp: int) -> Trace:
    """A rank drains, then receives new work later in the same wave (restart mid-wave)."""
    events: list[Event] = [Add(0, "rd-long", 8, 20), Add(1 % dp, "rd-short", 8, 2)]
    events += [WaitTokens("rd-long", 8), Add(1 % dp, "rd-again", 16, 4)]
    if dp > 2:
        events += [Sleep(0.05), Add(dp - 1, "rd-late", 8, 3)]
    return Trace(f"restart_after_drain-dp{dp}", dp, events)


PATTERNS = (
    drain_early,
    late_wave_start,
    staggered,
    one_rank_idle,
    saturate_cap,
    waves,
    aborts,
    restart_after_drain,
)


def fixed_traces(dp: int) -> list[Trace]:
    return [pattern(dp) for pattern in PATTERNS]


def random_trace(seed: int, dp: int) -> Trace:
    """A randomized trace: 1-3 waves, staggered arrivals, idle ranks, cap pressure, aborts."""
    rng = random.Random(seed)
    ids = _ids(f"s{seed}")
    events: list[Event] = []
    for wave in range(rng.randint(1, 3)):
        if wave:
            events.append(WaitWaveEnd())
        if rng.random() < 0.3:
            events.append(DelayWaveStart(rng.choice((0.05, 0.2))))
        idle = {r for r in range(dp) if rng.random() < 0.25}
        live: list[tuple[int, str, int]] = []
        for _ in range(rng.randint(1, 3 * CAP)):
            rank = rng.choice([r for r in range(dp) if r not in idle] or [0])
            request_id = next(ids)
            max_tokens = rng.randint(1, 20)
            events.append(Add(rank, request_id, rng.randint(4, 96), max_tokens))
            live.append((rank, request_id, max_tokens))
            if rng.random() < 0.3:
                events.append(Sleep(rng.choice((0.005, 0.02, 0.05))))
            if rng.random() < 0.15 and max_tokens > 2:
                # Abort only after the request produced a token: an ADD and an ABORT handled in
                # the same input-queue drain on an idle rank would leave that rank paused while
                # the others were woken (an upstream wave race, not what this suite tests).
                events.append(WaitTokens(request_id, 1))
                events.append(Abort(rank, (request_id,)))
    return Trace(f"random-{seed}-dp{dp}", dp, events)


def soak_traces(count: int, first_seed: int = 0) -> list[Trace]:
    """``count`` random traces, seeds from ``first_seed``, spread evenly over ``DP_SIZES`` (seed
    ``i`` runs at ``DP_SIZES[i % 3]``): the soak's set, and its first few the CI's slice of it."""
    return [
        random_trace(seed, DP_SIZES[(seed - first_seed) % len(DP_SIZES)])
        for seed in range(first_seed, first_seed + count)
    ]
