"""What a multiproc trace is made of, and what playing one returns (``harness.Cluster.run_trace``).

A trace is a list of events (``Add``, ``Abort``, ``WaitTokens``, ``WaitWaveEnd``, ``Sleep``,
``DelayWaveStart``, ``Kill``); the result carries every request's state and every rank's records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


# ---------------------------------------------------------------- trace events
@dataclass(frozen=True)
class Add:
    rank: int
    request_id: str
    prompt_len: int
    max_tokens: int


@dataclass(frozen=True)
class Abort:
    rank: int
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class WaitTokens:
    """Block the script until ``request_id`` has produced ``n`` tokens (or finished)."""

    request_id: str
    n: int


@dataclass(frozen=True)
class WaitWaveEnd:
    """Block until every live request finished and the DP wave completed (engines paused)."""


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class DelayWaveStart:
    """The coordinator holds the next START_DP_WAVE broadcast for ``seconds`` (late input)."""

    seconds: float


@dataclass(frozen=True)
class Kill:
    """SIGKILL one rank (fault injection)."""

    rank: int


Event = Add | Abort | WaitTokens | WaitWaveEnd | Sleep | DelayWaveStart | Kill


@dataclass
class Trace:
    name: str
    dp_size: int
    events: list[Event]
    note: str = ""


# ---------------------------------------------------------------- results
class Hang(Exception):
    """The cluster stopped making progress; carries every rank's stack dump."""

    def __init__(self, what: str, stacks: dict[int, str]):
        super().__init__(f"no progress while waiting for {what}")
        self.what = what
        self.stacks = stacks


@dataclass
class RequestState:
    rank: int
    max_tokens: int
    tokens: int = 0
    finish_reason: Any = None
    aborted: bool = False


@dataclass
class TraceResult:
    trace: Trace
    requests: dict[str, RequestState]
    records: dict[int, list]
    waves: int
    seconds: float
