"""Reading the Python stack dumps of hung engine cores (faulthandler's format)."""

from __future__ import annotations

import re


def main_thread_frames(stack_dump: str) -> list[str]:
    """Function names (innermost first) of the thread running the engine-core busy loop."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack_dump)
    for thread in reversed(threads):  # the latest dump comes last
        frames = re.findall(r'File "[^"]+", line \d+ in (\S+)', thread)
        if "run_busy_loop" in frames:
            return frames
    return []
