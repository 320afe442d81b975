"""Polling a condition until it holds or a deadline passes: the one such wait of the test bed and
the tests."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(
    condition: Callable[[], object],
    timeout_s: float,
    poll_s: float = 0.2,
    pause: Callable[[float], object] = time.sleep,
) -> float | None:
    """Seconds (to a tenth) until ``condition()`` is true, asked every ``poll_s`` while less than
    ``timeout_s`` has passed; None once it has (0.0 is a success: test for ``None``).

    What the condition raises propagates: one that knows waiting cannot help (the child exited)
    raises. ``pause(poll_s)`` is the wait between asks: ``time.sleep``, or what a caller that must
    keep serving something meanwhile runs instead (a message pump).
    """
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if condition():
            return round(time.monotonic() - began, 1)
        pause(poll_s)
    return None
