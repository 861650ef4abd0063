"""This process's autogroup: the scheduling group Linux gives a session, and its nice value.

With autogroup on (the default of most distributions' kernels, and of this project's hosts), the fair scheduler
first shares the cores between groups by the groups' weights, and only then between the threads of a group by
theirs. A thread's own nice value or class orders it against the threads of its group alone. `hybridserve up`
starts each service in a session of its own, so each is a group, and what weighs one service against another
is the group's nice value (`/proc/self/autogroup`). The gateway lowers its group's (it reads every token);
prefill_gpu on a CPU can raise its own (opt-in: its prefill then leaves the cores to a decode step). Both act
only where the group is the process's own: a service started from a shell shares the shell's group, which
belongs to whoever started it. Engines in containers compete by their cgroups' weights instead.
"""
from __future__ import annotations

import logging
import os
import re
import time

log = logging.getLogger(__name__)

PATH = "/proc/self/autogroup"
RETRIES = 3  # writes retried after EAGAIN, the kernel's rate limit on unprivileged group changes


def owns_group() -> bool:
    """Whether this process leads its session, so that its autogroup is its own."""
    return os.getsid(0) == os.getpid()


def set_own_nice(nice: int, who: str, path: str = PATH) -> bool:
    """Give this process's autogroup the nice value `nice` where the group is this process's own. Returns
    whether it was set. A lower value than the group's needs what a thread's does (CAP_SYS_NICE or
    `ulimit -e`); a higher one needs nothing. `who` names the service in the log line of a refusal."""
    if not owns_group() or not os.path.exists(path):
        return False  # a group shared with a shell or a parent, or no autogroup here: left alone
    for _ in range(RETRIES + 1):
        try:
            with open(path, "w") as f:
                f.write(str(nice))
            return True
        except BlockingIOError:  # EAGAIN: without CAP_SYS_ADMIN the kernel takes one such write a host per 0.1 s
            time.sleep(0.11)
        except OSError as exc:  # what refuses a thread's nice refuses this too; or autogroup is off
            log.info("%s's autogroup keeps its nice value (%s)", who, exc)
            return False
    log.info("%s's autogroup keeps its nice value (the kernel kept answering EAGAIN)", who)
    return False


def nice_of(pid: int | str = "self") -> int | None:
    """The nice value of a process's autogroup (`/autogroup-N nice V`), or None where there is none."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            found = re.search(r"nice\s+(-?\d+)", f.read())
    except OSError:
        return None
    return int(found.group(1)) if found else None
