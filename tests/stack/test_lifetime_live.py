"""Engines end with the process that started them: real prefill_gpu, real arena, the launcher SIGKILLed.

A launcher (a stand-in for a pytest run that a time limit kills) starts prefill_gpu through the
harness and is SIGKILLed while the engine profiles itself at start, before it serves: prefill_gpu
must stop on its own, free its ports and remove its KV arena from /dev/shm. Before, it ran on (the
issue: two engines for 90 minutes, with their ports, 2.6 GB and a 256 MiB segment), and a SIGTERM
before serving left the arena behind. `hybridserve up` SIGKILLed with its stack serving is checked at
the end of tests/stack/test_up_pairs.py, on that test's stack.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from harness.process import listening
from services.kv.arena import SHM_DIR
from services.lifetime import alive
from services.prefill_gpu.settings import PrefillSettings
from tests.services_harness import ROOT

LAUNCHER = ("import sys, time; from pathlib import Path; from harness.services import Service; "
            "env = dict(a.split('=', 1) for a in sys.argv[2:]); "
            "s = Service('services.prefill_gpu', env, Path(sys.argv[1])).start(); "
            "print(s.proc.pid, s.port, s.metrics_port, flush=True); time.sleep(600)")


def test_prefill_gpu_stops_and_removes_its_arena_when_its_launcher_is_sigkilled(tmp_path):
    log = tmp_path / "prefill.log"
    env = {PrefillSettings.env_name("profile_at_start"): "true",  # the sweep: a window before serving
           PrefillSettings.env_name("profile_cache"): str(tmp_path / "profile"),
           PrefillSettings.env_name("arena_bytes"): str(16 << 20), PrefillSettings.env_name("kv_cache_mb"): "64"}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(log), *(f"{k}={v}" for k, v in env.items())],
                                cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pid, *ports = map(int, launcher.stdout.readline().split())
    try:
        deadline = time.monotonic() + 300
        while not (arena := re.search(r"KV arena (\S+): \d+ MiB", log.read_text())) or "profiling" not in arena.string:
            assert alive(pid), log.read_text()
            assert time.monotonic() < deadline, "prefill_gpu never started profiling"
            time.sleep(0.1)
        assert (SHM_DIR / arena[1]).exists()
        os.kill(launcher.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while alive(pid):
            assert time.monotonic() - t0 < 30, "prefill_gpu outlived its launcher"
            time.sleep(0.1)
        text = log.read_text()
        assert "is gone; stopping" in text and "serving gRPC" not in text, text  # stopped before serving
        assert not (SHM_DIR / arena[1]).exists()
        assert not [p for p in ports if listening(p)]
    finally:
        launcher.kill()
        launcher.wait()
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
