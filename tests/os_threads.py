"""This process's OS threads, counted once the threads just joined have left ``/proc`` (a joined thread's OpenMP
workers end after it, on their own time): for the tests that check no OpenMP pool stays behind."""

from __future__ import annotations

import os
import time


def os_threads() -> int:
    """The count once five readings 20 ms apart agree (at most 2 s)."""
    counts = [len(os.listdir("/proc/self/task"))]
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and (len(counts) < 5 or len(set(counts[-5:])) > 1):
        time.sleep(0.02)
        counts.append(len(os.listdir("/proc/self/task")))
    return counts[-1]
