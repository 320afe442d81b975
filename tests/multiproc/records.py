"""Per-process event log of an engine-core rank, read back by the harness.

Each record is a small msgpack-able list: the harness fetches and clears them with a UTILITY
request (``collective_rpc("harness_drain_records")``) that travels through the engine core's real
input queue, so it is answered only once the busy loop is idle again and no record is in flight.
"""

from __future__ import annotations

from typing import Any

_RECORDS: list[list[Any]] = []


def append(kind: str, **fields: Any) -> None:
    _RECORDS.append([kind, fields])


def drain() -> list[list[Any]]:
    drained = list(_RECORDS)
    _RECORDS.clear()
    return drained
