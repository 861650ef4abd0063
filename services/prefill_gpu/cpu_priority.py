"""prefill_gpu's CPU scheduling class and group when its engine computes on the CPU: the decode engine's threads first.

On a host without a GPU, prefill_gpu's torch prefill and decode_fpga's PoCL kernels share the same cores.
A decode step is many short kernel launches, and each one wakes PoCL's worker threads. Linux's fair
scheduler (EEVDF, 6.6 on) lets a running thread finish its slice (~1.4 ms on the 2-core host) before a
thread that wakes at the same priority runs, so every wake-up of a decode step could wait behind a
prefill thread. With a 512-token prefill chunk running beside it, a 20 ms decode step grew to 164-315 ms.
A lower nice value does not lift that slice protection; the SCHED_IDLE class does. A normal thread that
wakes always preempts an idle-class one at once, and an idle-class thread still gets every cycle that
nothing else wants. bench/long_prompt_gaps.py measures the effect: see docs/readiness.md, "Settled".

The cost, and why it is opt-in (HYBRIDSERVE_PREFILL_CPU_PRIORITY=idle; the default stays normal): an
idle-class thread gets almost nothing while any normal thread of its group wants the core. On a host busy
with other work the prefill then waits for all of it. In runs here beside other work, the long prompts took
1.1-2.4 times as long with idle, and the stream's gaps grew as well. The other work was not the same in both
variants, so these runs indicate the cost; they do not measure it. One likely cause: a group's weight on a
core follows the load of its threads there, and an idle-class thread's load is tiny. A test suite running
engines beside other tests' work would starve its hybrid prefills the same way. So idle is for a host that
runs the stack alone. There it is the measured fix: the largest gaps were 69-115 ms against 107-175 ms, and
a long prompt's prefill was 0-7% slower.

Where each acts: Linux groups tasks by session (autogroup) or cgroup, shares the cores between groups by the groups'
weights, and only then between a group's threads. `hybridserve up` starts each engine in a session of its own, so
the engines are two groups. The idle class still acts across them at a wake-up (a normal thread that wakes preempts
an idle-class one on its core), but over time the prefill's group keeps half the cores: under a stream's largest
gaps, decode_fpga's gRPC and event-engine threads sat runnable for 60-110 ms while torch's threads ran. So the
process can also raise its group's nice value on the CPU (`apply_group_nice`, HYBRIDSERVE_PREFILL_CPU_GROUP_NICE;
raising needs no privilege): at 10 its group weighs ~1/10 of the decode engine's and gets the cycles that group
leaves. Also opt-in, for its cost: in hybrid mode the largest gaps held at 67-88 ms (63-156 ms without), but long
prompts' first tokens came ~25% later, and auto's largest gaps did not change (docs/readiness.md has the runs).
Engines in separate containers compete by their cgroups' weights instead, where neither setting orders one engine
against the other.

`apply` sets the class on every thread the process has now. Threads started later inherit it from their
creator: the gRPC server's pool, the engine loop's OpenMP team.
"""
from __future__ import annotations

import logging
import os

from services import autogroup
from services.process_threads import thread_ids

log = logging.getLogger(__name__)

CHOICES = ("normal", "idle")


def wanted(setting: str, device_type: str) -> str:
    """The class to run in: "idle" or "normal". idle only when the engine computes on the CPU: on CUDA the
    host threads only feed the GPU, and the decode engine's cores are not the prefill's."""
    if setting not in CHOICES:
        raise ValueError(f"cpu_priority must be one of {CHOICES}, got {setting!r}")
    return "idle" if setting == "idle" and device_type == "cpu" else "normal"


def apply(setting: str, device_type: str) -> str:
    """Put every thread of this process in the class `wanted` says. Returns what was set: "idle" or
    "normal" (also where the system has no SCHED_IDLE or refused it, with a warning then)."""
    choice = wanted(setting, device_type)
    if choice == "normal":
        return "normal"
    if not hasattr(os, "SCHED_IDLE"):
        log.warning("cpu_priority idle: this system has no SCHED_IDLE; prefill keeps the normal class")
        return "normal"
    try:
        for tid in thread_ids():
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # the thread ended meanwhile
                pass
    except OSError as exc:
        log.warning("cpu_priority idle: SCHED_IDLE refused (%s); prefill keeps the normal class", exc)
        return "normal"
    log.info("prefill threads in the SCHED_IDLE class: the decode engine's threads on these cores run first "
             "(HYBRIDSERVE_PREFILL_CPU_PRIORITY=idle: for a host that runs the stack alone)")
    return "idle"


def apply_group_nice(nice: int | None, device_type: str) -> int | None:
    """On the CPU, give this process's autogroup the nice value `nice` where the group is its own (as under
    `hybridserve up`). Returns the value set, or None where the group was left alone (on CUDA, not asked for, a
    shared group, no autogroup, or refused: a value below the group's needs CAP_SYS_NICE)."""
    if nice is None or device_type != "cpu" or not autogroup.set_own_nice(nice, "prefill_gpu"):
        return None
    log.info("prefill_gpu's scheduling group at nice %d: a decode engine's threads on these cores take them first "
             "(HYBRIDSERVE_PREFILL_CPU_GROUP_NICE; empty leaves the group alone)", nice)
    return nice
