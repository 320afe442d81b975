"""Workloads: arrival times and prompt/output lengths, generated from a seed or read from a trace.

Every policy in one run replays the same list of :class:`Arrival`s, so differences between
policies come from scheduling and routing, never from the workload.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the command line answers --help without numpy
    import numpy as np


@dataclass(frozen=True)
class Arrival:
    index: int
    time_s: float
    prompt_len: int
    output_len: int


class WorkloadError(ValueError):
    """A workload option or trace that cannot be used; the message says where and why."""


class TraceError(WorkloadError):
    """A bad trace line: the message names the file, the line number and the field."""


@dataclass(frozen=True)
class LengthDist:
    """``fixed:N``, ``uniform:LO:HI`` or ``longtail:MEAN[:SIGMA]`` (log-normal, mean MEAN)."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        kind, *raw = spec.split(":")
        try:
            params = tuple(float(p) for p in raw)
        except ValueError as exc:
            raise WorkloadError(
                f"length distribution {spec!r}: parameters must be numbers"
            ) from exc
        arity = {"fixed": (1,), "uniform": (2,), "longtail": (1, 2)}
        if kind not in arity:
            raise WorkloadError(
                f"length distribution {spec!r}: kind must be fixed, uniform or longtail"
            )
        if len(params) not in arity[kind] or any(p <= 0 for p in params):
            raise WorkloadError(
                f"length distribution {spec!r}: expected fixed:N, uniform:LO:HI or "
                "longtail:MEAN[:SIGMA] with positive numbers"
            )
        if kind == "uniform" and params[0] > params[1]:
            raise WorkloadError(f"length distribution {spec!r}: LO must be <= HI")
        return cls(kind, params)

    @property
    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.params[0] + self.params[1]) / 2
        return self.params[0]

    @property
    def upper_bound(self) -> int:
        """Largest length ``sample`` can return (long tails are clipped at 8x the mean)."""
        if self.kind == "fixed":
            return int(self.params[0])
        if self.kind == "uniform":
            return int(self.params[1])
        return int(8 * self.params[0])

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            import numpy as np

            values = np.full(n, self.params[0])
        elif self.kind == "uniform":
            values = rng.integers(int(self.params[0]), int(self.params[1]) + 1, size=n)
        else:
            # Log-normal with the requested mean: mu = ln(mean) - sigma^2 / 2.
            sigma = self.params[1] if len(self.params) > 1 else 1.0
            mu = math.log(self.params[0]) - sigma * sigma / 2
            values = rng.lognormal(mu, sigma, size=n)
        return [int(min(max(round(v), 1), self.upper_bound)) for v in values]


def inter_arrival_times(
    rng: np.random.Generator, n: int, rate_per_s: float, process: str, burstiness: float
) -> np.ndarray:
    """Gaps between arrivals: Poisson, or gamma-distributed as vLLM's serving benchmark does.

    ``bursty`` follows ``vllm bench serve --burstiness``: gamma gaps with shape ``burstiness`` and
    the same mean rate; shape 1 is Poisson, below 1 arrivals cluster into bursts.
    """
    if process == "poisson":
        return rng.exponential(1.0 / rate_per_s, size=n)
    if process == "bursty":
        return rng.gamma(burstiness, 1.0 / (rate_per_s * burstiness), size=n)
    raise WorkloadError(f"arrival process {process!r}: expected poisson or bursty")


def generate_arrivals(
    n: int,
    rate_per_s: float,
    prompt_len: LengthDist,
    output_len: LengthDist,
    seed: int,
    process: str = "poisson",
    burstiness: float = 0.25,
) -> list[Arrival]:
    import numpy as np

    # Independent streams: changing the length distribution leaves arrival times unchanged.
    times_rng, prompt_rng, output_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)
    )
    times = np.cumsum(inter_arrival_times(times_rng, n, rate_per_s, process, burstiness))
    prompts = prompt_len.sample(prompt_rng, n)
    outputs = output_len.sample(output_rng, n)
    return [Arrival(i, round(float(times[i]), 9), prompts[i], outputs[i]) for i in range(n)]


def rate_for_concurrency(concurrency: float, mean_output_len: float, step_time_s: float) -> float:
    """Arrival rate that keeps ``concurrency`` requests in flight (Little's law).

    A request stays ~``mean_output_len`` steps (one token per step); ``step_time_s`` is the
    model's step time at the target load, so rate = concurrency / (output_len * step_time).
    """
    return concurrency / (mean_output_len * step_time_s)


TRACE_FIELDS = ("arrival_time", "prompt_len", "output_len")


def _trace_field(path: Path, lineno: int, record: dict, field: str) -> float:
    if field not in record:
        raise TraceError(f"{path}:{lineno}: field {field!r} is missing")
    value = record[field]
    if field == "arrival_time":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        expected = "a number of seconds >= 0"
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        expected = "an integer >= 1"
    if not ok:
        raise TraceError(f"{path}:{lineno}: field {field!r} must be {expected}, got {value!r}")
    return value


def load_trace(path: str | Path) -> list[Arrival]:
    """Read a JSONL trace: one object per line with arrival_time (s), prompt_len, output_len.

    Blank lines are skipped; arrivals are replayed in time order (stable for equal times).
    """
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    try:
        lines = path.open()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc.strerror})") from exc
    with lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise TraceError(f"{path}:{lineno}: expected an object with {TRACE_FIELDS}")
            arrival, prompt, output = (_trace_field(path, lineno, record, f) for f in TRACE_FIELDS)
            rows.append((float(arrival), int(prompt), int(output)))
    if not rows:
        raise TraceError(f"{path}: the trace has no requests")
    rows.sort(key=lambda row: row[0])
    return [Arrival(i, t, p, o) for i, (t, p, o) in enumerate(rows)]
