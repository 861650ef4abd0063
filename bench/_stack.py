"""Bring the whole stack up for a benchmark (`hybridserve up` on free ports) and down again."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from _common import ROOT, progress


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    proc: subprocess.Popen
    ports: dict

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['HYBRIDSERVE_GATEWAY_PORT']}"

    @property
    def decode_address(self) -> str:
        return f"127.0.0.1:{self.ports['HYBRIDSERVE_DECODE_PORT']}"

    @property
    def prefill_address(self) -> str:
        return f"127.0.0.1:{self.ports['HYBRIDSERVE_PREFILL_PORT']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def start_stack(log_path, extra_env: dict | None = None, timeout: float = 900) -> Stack:
    names = ("HYBRIDSERVE_GATEWAY_PORT", "HYBRIDSERVE_PREFILL_PORT", "HYBRIDSERVE_PREFILL_METRICS_PORT",
             "HYBRIDSERVE_DECODE_PORT", "HYBRIDSERVE_DECODE_METRICS_PORT")
    ports = {n: _free_port() for n in names}
    env = {**os.environ, **{k: str(v) for k, v in ports.items()}, **(extra_env or {})}
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    stack = Stack(proc, ports)
    deadline = time.monotonic() + timeout
    progress(f"starting the stack (log: {log_path})")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the stack exited; see {log_path}")
        try:
            with urllib.request.urlopen(stack.url + "/health", timeout=2) as r:
                if r.status == 200:
                    progress(f"stack up at {stack.url}")
                    return stack
        except OSError:
            pass
        time.sleep(1)
    stack.stop()
    raise TimeoutError(f"the stack did not come up in {timeout}s; see {log_path}")
