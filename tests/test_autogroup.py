"""A process's autogroup nice value (services/autogroup.py): set where the group is the process's own, read back
from the kernel; a group shared with others (a shell's, pytest's) left alone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services import autogroup
from tests.services_harness import ROOT

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no autogroup in this kernel")

CHILD = """
import sys
from services import autogroup
print(autogroup.owns_group(), autogroup.set_own_nice(int(sys.argv[1]), "a test"), autogroup.nice_of())
"""


def run_child(nice: int, own_session: bool) -> list[str]:
    return subprocess.run([sys.executable, "-c", CHILD, str(nice)], cwd=ROOT, capture_output=True, text=True,
                          check=True, timeout=60, start_new_session=own_session).stdout.split()


def test_a_process_that_leads_its_session_sets_its_groups_nice():
    """Started in a session of its own (as `hybridserve up` starts each service), a process's group is its own:
    raising its nice value needs no privilege, and the kernel reports the new value."""
    assert run_child(7, own_session=True) == ["True", "True", "7"]


def test_a_shared_autogroup_is_left_alone():
    """A process that does not lead its session shares its group with the session's leader (a shell, here
    pytest's): its setting must not change that group."""
    before = autogroup.nice_of()
    assert run_child(7, own_session=False) == ["False", "False", str(before)]
    assert autogroup.nice_of() == before


def test_nice_of_reads_a_processes_group_and_none_without_one():
    """A process that leads a new session has a group of its own, which the kernel shows at nice 0 to any
    reader. The runner's own session may have none: a session begun where autogroup was off, as in some CI
    containers, sits in the root group and its file is empty; so only a child's group is asserted here."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert autogroup.nice_of(child.pid) == 0
    finally:
        child.kill()
        child.wait(timeout=10)
    assert autogroup.nice_of(os.getpid()) == autogroup.nice_of()  # "self" and the pid name one file
    assert autogroup.nice_of(2 ** 22 + 12345) is None  # no such process
