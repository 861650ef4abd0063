"""prefill_gpu's serving CPU class (services/prefill_gpu/cpu_priority.py): SCHED_IDLE when asked for, every thread;
and its scheduling group's nice value on the CPU.

The class must reach the threads that compute: those there when it is applied, and those started later
(the gRPC server's pool, the engine loop's OpenMP team). So these tests read each thread's class from the
kernel in a real process: a child Python for `apply`, and a real prefill_gpu service for its start-up.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services import autogroup
from services.prefill_gpu import cpu_priority
from services.prefill_gpu.settings import PrefillSettings
from tests.services_harness import Service

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")

CHILD = """
import os, sys, threading
from services.prefill_gpu import cpu_priority
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
print(cpu_priority.apply(sys.argv[1], sys.argv[2]))
after = threading.Thread(target=stop.wait); after.start()
print(sorted(os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")))
stop.set()
"""


def thread_classes(pid: int | str = "self") -> list[int]:
    return [os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")]


def run_child(setting: str, device: str) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", CHILD, setting, device], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split("\n")
    return out[0], eval(out[1])  # a list of ints the child printed


def test_idle_is_opt_in_and_for_the_cpu_only():
    assert PrefillSettings().cpu_priority == "normal"  # idle starves the prefill on a busy host
    assert cpu_priority.wanted("idle", "cpu") == "idle"
    assert cpu_priority.wanted("idle", "cuda") == "normal"
    assert cpu_priority.wanted("normal", "cpu") == "normal"
    with pytest.raises(ValueError, match="cpu_priority"):
        cpu_priority.wanted("auto", "cpu")


def test_apply_puts_every_thread_in_the_idle_class_those_started_later_too():
    taken, classes = run_child("idle", "cpu")
    assert taken == "idle"
    assert len(classes) == 3 and set(classes) == {os.SCHED_IDLE}, classes  # main, before, after


@pytest.mark.parametrize("setting,device", [("idle", "cuda"), ("normal", "cpu")])
def test_normal_leaves_every_thread_in_the_normal_class(setting, device):
    taken, classes = run_child(setting, device)
    assert taken == "normal"
    assert set(classes) == {os.SCHED_OTHER}, classes


def test_the_group_nice_value_is_opt_in_for_the_cpu_only_and_empty_leaves_the_group_alone(monkeypatch):
    monkeypatch.delenv("HYBRIDSERVE_PREFILL_CPU_GROUP_NICE", raising=False)
    assert PrefillSettings().cpu_group_nice is None  # long prompts' first tokens pay for it (docs/readiness.md)
    assert PrefillSettings.from_environ({"HYBRIDSERVE_PREFILL_CPU_GROUP_NICE": "10"}).cpu_group_nice == 10
    assert PrefillSettings.from_environ({"HYBRIDSERVE_PREFILL_CPU_GROUP_NICE": ""}).cpu_group_nice is None
    assert cpu_priority.apply_group_nice(10, "cuda") is None  # on CUDA the prefill's cores are not the decode's
    assert cpu_priority.apply_group_nice(None, "cpu") is None
    if not autogroup.owns_group():  # pytest started from a shell or make: the group is theirs, not pytest's
        assert cpu_priority.apply_group_nice(10, "cpu") is None


def test_the_service_on_the_cpu_serves_from_the_idle_class_in_a_group_at_the_nice_value_asked_for(tmp_path):
    """A real prefill_gpu with HYBRIDSERVE_PREFILL_CPU_PRIORITY=idle and HYBRIDSERVE_PREFILL_CPU_GROUP_NICE=10, started
    in a session of its own as `hybridserve up` starts it: once it serves, every thread of it (gRPC's and torch's
    among them) is SCHED_IDLE, its autogroup is at nice 10, and the test's own process kept its class and group."""
    own_group = autogroup.nice_of()
    env = {PrefillSettings.env_name(k): str(v) for k, v in {
        "device": "cpu", "cpu_priority": "idle", "cpu_group_nice": 10, "kv_cache_mb": 64, "arena_bytes": 16 << 20,
        "max_num_seqs": 2}.items()}
    svc = Service("services.prefill_gpu", env, tmp_path / "prefill.log").start()
    try:
        svc.wait_healthy(timeout=300)
        classes = thread_classes(svc.proc.pid)
        group = autogroup.nice_of(svc.proc.pid)
    finally:
        svc.stop()
    assert len(classes) > 3 and set(classes) == {os.SCHED_IDLE}, classes
    assert set(thread_classes()) == {os.SCHED_OTHER}
    if os.path.exists("/proc/self/autogroup"):  # a kernel with autogroup; pytest's own group may be the root's
        assert group == 10, svc.log_path.read_text()[-2000:]  # (empty file, as in CI): the service has its own
        assert autogroup.nice_of() == own_group
