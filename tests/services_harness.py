"""Start the real services as processes on loopback for tests, and stop them cleanly."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    module: str
    env: dict
    log_path: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Service":
        env = {**os.environ, "HYBRIDSERVE_PORT": str(self.port), "HYBRIDSERVE_METRICS_PORT": str(self.metrics_port),
               "HYBRIDSERVE_PROFILE_AT_START": "false", **self.env}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module], cwd=ROOT, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        return self

    def wait_healthy(self, timeout: float = 120.0) -> "Service":
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.module} exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                        return self
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        raise TimeoutError(f"{self.module} not healthy after {timeout}s:\n{self.log_tail()}")

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-n:])

    def stop(self, sig=signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()


def engine_pair(tmp: Path, prefill_env: dict | None = None, decode_env: dict | None = None):
    """prefill_gpu and decode_fpga, wired to each other, started in parallel (not yet waited for)."""
    cache = {"HYBRIDSERVE_PROFILE_CACHE": str(tmp / "profile")}
    prefill = Service("services.prefill_gpu", {**cache, **(prefill_env or {})}, tmp / "prefill.log").start()
    decode = Service("services.decode_fpga", {**cache, "HYBRIDSERVE_PREFILL_ADDRESS": prefill.address,
                                              **(decode_env or {})}, tmp / "decode.log").start()
    return prefill, decode


def start_gateway(tmp: Path, prefill: Service, decode: Service, env: dict | None = None) -> Service:
    gw = Service("services.gateway", {"HYBRIDSERVE_PREFILL_ADDRESS": prefill.address,
                                      "HYBRIDSERVE_DECODE_ADDRESS": decode.address, "HYBRIDSERVE_LOG_LEVEL": "WARNING",
                                      **(env or {})}, tmp / "gateway.log")
    gw.env["HYBRIDSERVE_GATEWAY_PORT"] = str(gw.port)
    return gw.start()


def wait_http_ok(svc: Service, path: str = "/health", timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if svc.proc.poll() is not None:
            raise RuntimeError(f"{svc.module} exited:\n{svc.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{svc.port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{svc.module}{path} not OK after {timeout}s:\n{svc.log_tail()}")
