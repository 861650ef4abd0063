"""The gateway's CPU priority: its threads take a core before the engines' threads where the system allows it.

On a host without a GPU, prefill_gpu's torch prefill threads and decode_fpga's OpenCL work-groups take every
core. The gateway's work per token is small (its GIL was held 3.5% of the time), but each token waits for a
core before the gateway reads it from gRPC and writes its SSE chunk. So the gateway's threads take nice -10 by
default (HYBRIDSERVE_GATEWAY_CPU_NICE; empty: leave the priority alone), and the gateway's hop (gRPC `sent` →
gateway `recv`) fell on the 2-core host from a p99 of 50-111 ms to 10-11 ms; docs/readiness.md ("Where the time
under those gaps goes") has the runs, and what the stream's largest gaps did.

Lowering a nice value (below 0, from the usual 0) needs CAP_SYS_NICE (compose: `cap_add: [SYS_NICE]`) or
an RLIMIT_NICE that allows it (`ulimit -e`). Without either the system refuses it; the gateway then says so
once (a warning if the value was set on purpose, else at info level) and serves at the priority it has.

Where it acts: Linux weighs threads by nice within their scheduling group (a cgroup; with autogroup on, a
session) and shares the cores between groups by the groups' weights. `hybridserve up` starts each service in a
session of its own, so on the 2-core host (autogroup on, every process in the root cpu cgroup) the gateway was a
group of its own, and its threads' nice value ordered them only against each other. So `apply` also sets the
nice value of the gateway's autogroup where that group is the gateway's own (it leads its session; a gateway
started from a shell shares the shell's group, which it leaves alone): the event loop's stalls over 50 ms fell
from 16 to 4 in the runs readiness.md gives. Engines in other containers compete by their cgroups' weights;
what -10 does there is not measured.

`apply` sets the value on every thread the process has now. Threads started later (asyncio's executor,
gRPC's) inherit it from their creator. `python -m services.gateway` calls it before it serves;
create_app does not, so tests that build the app in-process leave pytest's priority alone.
"""
from __future__ import annotations

import logging
import os

from services import autogroup
from services.process_threads import thread_ids

log = logging.getLogger(__name__)


def apply(nice: int | None, asked: bool = True) -> int | None:
    """Give every thread of this process the nice value `nice`. Returns the value taken; None where the
    system refused it (every thread left as it was, logged: a warning when `asked`, the value set on purpose;
    at info level for the default, which an unprivileged `make run` cannot take and need not be warned
    about). `nice` None: nothing is changed and the calling thread's nice value is returned."""
    if nice is None:
        return os.getpriority(os.PRIO_PROCESS, 0)
    was = {}
    for tid in thread_ids():
        try:
            was[tid] = os.getpriority(os.PRIO_PROCESS, tid)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    # the threads it lowers first: only lowering needs privilege, so a refusal comes before any thread was
    # raised, and undoing a lowering (raising it back) is always allowed
    changed: list[int] = []
    try:
        for tid in sorted(was, key=lambda t: was[t] <= nice):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except ProcessLookupError:
                continue
            changed.append(tid)
    except OSError as exc:
        for tid in changed:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, was[tid])
            except OSError:  # ended meanwhile
                pass
        log.log(logging.WARNING if asked else logging.INFO,
                "cpu_nice %d refused (%s); the gateway keeps its priority (nice %d). A lower nice value needs "
                "CAP_SYS_NICE (compose: cap_add: [SYS_NICE]) or an RLIMIT_NICE that allows it (ulimit -e); "
                "HYBRIDSERVE_GATEWAY_CPU_NICE= (empty) does not ask", nice, exc, os.getpriority(os.PRIO_PROCESS, 0))
        return None
    autogroup.set_own_nice(nice, "the gateway")
    return nice
