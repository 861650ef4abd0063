"""The supervisor on real child processes (small Python ones), with a hand-moved clock for the backoff."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from services.launcher.supervisor import RESTARTS, ChildSpec, Supervisor

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
FAIL = [sys.executable, "-c", "import sys; sys.exit(3)"]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def said():
    return []


def supervisor(specs, said, clock, **kw) -> Supervisor:
    start = lambda spec: subprocess.Popen(spec.argv)  # noqa: E731
    return Supervisor(specs, start, said.append, backoff_s=1.0, backoff_max_s=4.0, stable_s=60.0,
                      clock=clock, **kw)


def test_an_exiting_child_restarts_with_doubling_capped_backoff(said):
    clock = Clock()
    sup = supervisor([ChildSpec("flaky", FAIL, {})], said, clock)
    before = RESTARTS.labels(service="flaky")._value.get()
    sup.start_all()
    delays = []
    for _ in range(5):
        sup.children["flaky"].proc.wait()
        sup.poll()  # notices the exit, schedules the restart
        delays.append(sup.children["flaky"].restart_at - clock.now)
        clock.now += delays[-1]
        sup.poll()  # due: started again
        assert sup.children["flaky"].proc is not None
    assert delays == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert sup.restarts("flaky") == 5 and RESTARTS.labels(service="flaky")._value.get() == before + 5
    assert "flaky exited (exit code 3); starting it again in 4.0s" in said and "restarting flaky (restart 5)" in said
    # a run past stable_s starts the backoff over
    sup.children["flaky"].proc.wait()
    clock.now += 61
    sup.poll()
    assert sup.children["flaky"].restart_at - clock.now == 1.0
    sup.stop_all(["flaky"])


def test_a_follower_restarts_with_its_leader_once_the_leader_is_ready(said):
    clock = Clock()
    leader_ready = {"ok": False}
    specs = [ChildSpec("leader", SLEEP, {}, ready=lambda: leader_ready["ok"]),
             ChildSpec("follower", SLEEP, {}, follows="leader"), ChildSpec("other", SLEEP, {})]
    sup = supervisor(specs, said, clock)
    sup.start_all()
    old_follower, other = sup.children["follower"].proc, sup.children["other"].proc
    try:
        sup.children["leader"].proc.send_signal(signal.SIGKILL)
        sup.children["leader"].proc.wait()
        sup.poll()
        assert old_follower.poll() is not None  # stopped with its leader (SIGTERM)
        assert "leader exited (killed by SIGKILL); starting it again in 1.0s" in said
        assert sup.children["follower"].proc is None and other.poll() is None  # the others untouched
        clock.now += 1.0
        sup.poll()
        assert sup.children["leader"].proc is not None and sup.children["follower"].proc is None  # leader not ready
        leader_ready["ok"] = True
        sup.poll()
        assert sup.children["follower"].proc is not None
        assert sup.restarts("leader") == 1 and sup.restarts("follower") == 1 and sup.restarts("other") == 0
    finally:
        procs = list(sup.procs.values())
        sup.stop_all(["other", "follower", "leader"])
    assert all(p.poll() is not None for p in procs)
    assert not sup.procs


def test_stop_all_ends_every_child_and_nothing_restarts(said):
    clock = Clock()
    sup = supervisor([ChildSpec("a", SLEEP, {}), ChildSpec("b", SLEEP, {})], said, clock)
    sup.start_all()
    pids = [p.pid for p in sup.procs.values()]
    sup.stop_all(["a", "b"])
    clock.now += 100
    sup.poll()
    assert not sup.procs
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
