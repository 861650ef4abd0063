"""A child process ends with the process that started it: `exit_with_parent` (HYBRIDSERVE_PARENT_PID).

`hybridserve up` and the test harness start the services with HYBRIDSERVE_PARENT_PID set to their own
pid. Each service then watches that process from a daemon thread and, once it is gone (it exited,
crashed or was SIGKILLed), sends itself SIGTERM: the service's ordinary way out, which for
prefill_gpu removes its KV arena from /dev/shm. A child that is still running `stop_after_s`
later (a shutdown that hangs) is killed outright, so nothing lingers with its ports and memory.

Why a watch and not prctl(PR_SET_PDEATHSIG): the kernel sends that signal when the parent *thread*
that forked the child exits, and tests start services from short-lived threads too; a pid (with its
start time, so a reused pid does not count) says which process the child belongs to.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


def process_start(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of `pid` from /proc/<pid>/stat; None if it is gone.
    The pid with its start time names one process: a pid the kernel reused has another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # fields after "pid (comm)" start at field 3
    return fields[0], fields[19]


def alive(pid: int, started: str | None = None) -> bool:
    """Whether `pid` runs (not a zombie: a killed parent is one until its own parent reaps it), and
    is the process that started at `started` when that is given."""
    info = process_start(pid)
    return info is not None and info[0] not in ("Z", "X") and (started is None or info[1] == started)


def launch_env() -> dict[str, str]:
    """What a launcher adds to a child's environment so that the child ends with it."""
    from services.settings import CommonSettings

    return {CommonSettings.env_name("parent_pid"): str(os.getpid())}


def exit_with_parent(parent_pid: int, what: str, interval_s: float = 0.5,
                     stop_after_s: float = 60.0) -> threading.Thread | None:
    """Watch `parent_pid` (0: nobody, no watch); when it is gone, SIGTERM this process, and SIGKILL it if it
    still runs `stop_after_s` later. `what` names this process in the log."""
    if not parent_pid:
        return None
    info = process_start(parent_pid)
    started = info[1] if info else None

    def watch() -> None:
        while info is not None and alive(parent_pid, started):
            time.sleep(interval_s)
        log.warning("%s: the process that started it (pid %d) is gone; stopping", what, parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(stop_after_s)
        log.error("%s: still running %.0fs after its parent went; killing it", what, stop_after_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread
