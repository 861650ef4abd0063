"""The gateway's CPU priority (services/gateway/cpu_priority.py): every thread at HYBRIDSERVE_GATEWAY_CPU_NICE, or
every thread as it was where the system refuses it.

The value must reach every thread that reads tokens: those there when it is applied and those started later.
So these tests read each thread's nice value from the kernel in real processes: a child Python for `apply`,
and a real gateway for its start. Only a privileged process may lower a nice value: as root the tests ask for
-10 and check the refusal in a child that dropped to uid 65534 (nobody) itself (the venv's interpreter may lie
where nobody cannot read it, so the child cannot simply be started as nobody); as anyone else they raise the
value, which anyone may do, and the refusal is their own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from services import autogroup
from services.gateway.settings import GatewaySettings
from tests.services_harness import ROOT, Service, free_port, wait_http_ok

ROOT_USER = os.geteuid() == 0
BASE = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's nice value, which the children start from

CHILD = """
import json, logging, os, sys, threading
from services.gateway import cpu_priority
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
asked = None if sys.argv[1] == "none" else int(sys.argv[1])
stop, set_up = threading.Event(), threading.Event()
def own_nice(value):  # a thread that sets its own nice value, then waits
    os.setpriority(os.PRIO_PROCESS, 0, value); set_up.set(); stop.wait()
before = threading.Thread(target=own_nice, args=(int(sys.argv[2]),)); before.start(); set_up.wait()
if sys.argv[3] == "drop":  # root becomes nobody, in every thread, and loses its capabilities with uid 0
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
def nices():
    return {t: os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}
was = nices()
taken = cpu_priority.apply(asked, asked=sys.argv[4] == "asked")
after = threading.Thread(target=stop.wait); after.start()
print(json.dumps({"taken": taken, "was": was, "now": nices(), "uid": os.geteuid()}))
stop.set()
"""


def run_child(asked: int | None, before_thread_nice: int = 0, drop: bool = False,
              on_purpose: bool = True) -> tuple[dict, str]:
    """apply(asked) in a fresh Python with one thread started before (at its own nice value) and one after:
    what it printed (taken, each thread's nice before and after) and its stderr."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(asked).lower(), str(before_thread_nice),
                          "drop" if drop else "stay",
                          "asked" if on_purpose else "default"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def thread_nices(pid: int | str = "self") -> dict[str, int]:
    return {t: os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def refused(log: str) -> bool:
    return "refused" in log and "keeps its priority" in log and "CAP_SYS_NICE" in log and "ulimit -e" in log


def test_the_default_is_minus_10_and_empty_leaves_the_priority_alone():
    assert GatewaySettings.env_name("cpu_nice") == "HYBRIDSERVE_GATEWAY_CPU_NICE"
    assert GatewaySettings.from_environ({}).cpu_nice == -10
    assert GatewaySettings.from_environ({"HYBRIDSERVE_GATEWAY_CPU_NICE": ""}).cpu_nice is None
    assert GatewaySettings.from_environ({"HYBRIDSERVE_GATEWAY_CPU_NICE": "0"}).cpu_nice == 0


def test_apply_sets_every_thread_those_started_later_too():
    asked = -10 if ROOT_USER else min(BASE + 5, 19)  # lowering needs privilege; anyone may raise
    got, log = run_child(asked)
    assert got["taken"] == asked, log
    assert len(got["now"]) == 3 and set(got["now"].values()) == {asked}, got  # main, before, after
    assert not refused(log)


def test_none_changes_nothing():
    got, _ = run_child(None, before_thread_nice=BASE + 3)
    assert got["taken"] == BASE  # the calling thread's
    # the thread started after inherits the main thread's
    assert sorted(got["now"].values()) == [BASE, BASE, BASE + 3], got


def test_a_refused_value_leaves_every_thread_as_it_was_with_one_warning():
    """An unprivileged process asks for -10: refused, None, every thread's nice value unchanged, one warning
    saying what grants it."""
    got, log = run_child(-10, before_thread_nice=BASE + 2, drop=ROOT_USER)
    assert got["uid"] != 0
    assert got["taken"] is None
    assert sorted(got["was"].values()) == [BASE, BASE + 2]
    assert all(got["now"][t] == n for t, n in got["was"].items()), got
    assert sorted(got["now"].values()) == [BASE, BASE, BASE + 2], got  # the one started after: the main's
    assert refused(log) and log.count("refused") == 1 and log.startswith("WARNING "), log


def test_a_refused_default_is_said_at_info_level():
    """The default, not set on purpose, refused (an unprivileged `make run`): said once, as information, since
    nothing is wrong; every thread as it was."""
    got, log = run_child(-10, drop=ROOT_USER, on_purpose=False)
    assert got["taken"] is None and all(got["now"][t] == n for t, n in got["was"].items()), got
    assert refused(log) and log.startswith("INFO ") and "WARNING" not in log, log


def test_a_refusal_part_way_changes_no_thread():
    """Asking for 1 with threads at 0 and 2 (above the start): raising the first is allowed, lowering the second
    is not. The value is refused and neither thread moves (the one it may raise is not raised, as it could not
    be lowered back)."""
    got, log = run_child(BASE + 1, before_thread_nice=BASE + 2, drop=ROOT_USER)
    assert got["taken"] is None and refused(log), log
    assert sorted(got["was"].values()) == [BASE, BASE + 2]
    assert all(got["now"][t] == n for t, n in got["was"].items()), got


def test_the_gateway_process_serves_at_its_nice_value(tmp_path, monkeypatch):
    """A real gateway (no engines: its liveness probe answers without them), started with the default: once it
    answers, every thread of it is at -10 as root, else all as they were with the warning in its log. The
    test's own process keeps its priority."""
    monkeypatch.delenv("HYBRIDSERVE_GATEWAY_CPU_NICE", raising=False)  # the default
    own = thread_nices()
    unused = {GatewaySettings.env_name("prefill_address"): f"127.0.0.1:{free_port()}",
              GatewaySettings.env_name("decode_address"): f"127.0.0.1:{free_port()}"}
    gw = Service("services.gateway", unused, tmp_path / "gateway.log").start()
    try:
        wait_http_ok(gw, "/livez", timeout=120)
        nices = thread_nices(gw.proc.pid)
        group = autogroup.nice_of(gw.proc.pid)
    finally:
        gw.stop()
    log = gw.log_path.read_text()
    assert len(nices) > 1, nices
    if ROOT_USER:
        assert set(nices.values()) == {-10}, (nices, log)
        assert not refused(log), log
        # the harness starts it in a session of its own, so its autogroup is its own and takes the value too
        # (read while it ran). The kernel's autogroup, not this process's: pytest's may be the root group, whose
        # file is empty (CI), while a service that leads its session still has one
        assert group == (-10 if os.path.exists("/proc/self/autogroup") else None), group
    else:
        assert set(nices.values()) == {os.getpriority(os.PRIO_PROCESS, 0)}, (nices, log)
        assert refused(log), log
    assert {t: n for t, n in thread_nices().items() if t in own} == own
