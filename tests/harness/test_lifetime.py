"""A process started through the harness ends with the process that started it (services/lifetime.py).

Real processes, no model: a launcher (a stand-in for pytest or `hybridserve up`) starts a child with
harness.process.Process and is SIGKILLed; the child must stop on its own, through SIGTERM (its
ordinary way out) or, if that hangs, SIGKILL. Before, such a child ran on for as long as it liked:
a killed test run left its engines running for 90 minutes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from services.lifetime import alive, exit_with_parent, launch_env, process_start
from services.settings import CommonSettings
from tests.services_harness import ROOT

LAUNCHER = ("import sys, time; from pathlib import Path; from harness.process import Process; "
            "p = Process('tests.harness.orphan', {}, Path(sys.argv[1]), args=tuple(sys.argv[2:])).start(); "
            "print(p.proc.pid, flush=True); time.sleep(600)")


def _launch(tmp_path, *args: str) -> tuple[subprocess.Popen, int]:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "orphan.log"), *args], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    _wait(lambda: "watching" in (tmp_path / "orphan.log").read_text(), 60, "the child watching")
    return launcher, child


def _wait(probe, within: float, what: str) -> float:
    start = time.monotonic()
    while not probe():
        assert time.monotonic() - start < within, f"never {what} within {within}s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_child_stops_with_sigterm_when_its_launcher_is_sigkilled(tmp_path):
    launcher, child = _launch(tmp_path)
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        # the launcher is a zombie until reaped here: that counts as gone (its children are orphans already)
        _wait(lambda: not alive(child), 10, "the child gone")
        log = (tmp_path / "orphan.log").read_text()
        assert "is gone; stopping" in log and "SIGTERM" in log
    finally:
        launcher.kill()
        launcher.wait()
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_whose_shutdown_hangs_is_killed(tmp_path):
    launcher, child = _launch(tmp_path, "0.5", "ignore")
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        _wait(lambda: not alive(child), 10, "the child gone")
        log = (tmp_path / "orphan.log").read_text()
        assert "SIGTERM ignored" in log and "killing it" in log
    finally:
        launcher.kill()
        launcher.wait()
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_launcher_names_itself_and_a_reused_pid_is_not_the_parent():
    assert launch_env() == {CommonSettings.env_name("parent_pid"): str(os.getpid())}
    assert CommonSettings.from_environ(launch_env()).parent_pid == os.getpid()
    state, started = process_start(os.getpid())
    assert alive(os.getpid(), started) and not alive(os.getpid(), str(int(started) + 1))
    assert exit_with_parent(0, "nobody's child") is None  # a service started by hand watches nothing
