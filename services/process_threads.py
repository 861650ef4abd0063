"""This process's threads by kernel id: what a scheduling setting must reach (prefill_gpu's and the gateway's
cpu_priority.py set every thread's class or nice value; threads started later inherit it from their creator)."""
from __future__ import annotations

import os


def thread_ids() -> list[int]:
    """Every thread of this process (/proc/self/task); [0], this thread, where there is no /proc."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread only (threads started later inherit from it)
        return [0]
