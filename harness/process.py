"""A child process on loopback: a free port for it, start it, wait until a probe passes, stop it."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


LOWEST_PORT = 20000  # free_port's ports lie in [LOWEST_PORT, the ephemeral range's start)
_handed_out: set[int] = set()  # free_port's ports of this process


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes an outgoing connection's local port from (Linux's default elsewhere)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, for a service to bind seconds later.

    Not the OS's choice (bind to port 0): that comes from the ephemeral range, from which every outgoing
    connection takes its local port too, so a client could hold it by the time the service binds (a
    fresh clone's `make test` once failed so: prefill_gpu's metrics port "Address already in use"). A
    random port below that range instead, never one this process handed out before."""
    lo, _ = ephemeral_ports()
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(LOWEST_PORT, lo) if lo > LOWEST_PORT + 1000 else rng.randrange(1024, 65536)
        if port not in _handed_out and port_is_free(port):
            _handed_out.add(port)
            return port
    raise RuntimeError("no free TCP port found on 127.0.0.1")


def free_strided_ports(stride: int, count: int) -> int:
    """A free port p with p + i x stride free too for i < count (`up --pairs`: pair i's ports are the
    first pair's plus i x its stride), none handed out before and all of them handed out now: a later
    free_port() once gave a gateway the port `up` then gave pair 1's decode_fpga for its metrics."""
    for _ in range(100):
        p = free_port()
        run = [p + stride * i for i in range(1, count)]
        if run and run[-1] >= 65536:
            continue
        if all(q not in _handed_out and port_is_free(q) for q in run):
            _handed_out.update(run)
            return p
    raise RuntimeError(f"no free ports {count} x {stride} apart")


def port_is_free(port: int) -> bool:
    """Whether TCP port `port` of 127.0.0.1 can be bound now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def listening(port: int) -> bool:
    """Whether something accepts connections on TCP port `port` of 127.0.0.1 (a closed server's
    connections in TIME_WAIT, or another process's client socket on that port, do not count)."""
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def http_ok(url: str) -> Callable[[], bool]:
    """A probe: `url` answers 200."""
    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False
    return probe


def grpc_serving(address: str) -> Callable[[], bool]:
    """A probe: the gRPC health service at `address` says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def probe() -> bool:
        with grpc.insecure_channel(address) as ch:
            try:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status
            except grpc.RpcError:
                return False
        return status == health_pb2.HealthCheckResponse.SERVING
    return probe


class Process:
    """`python -m <module> [args]` from the repository root, stdout and stderr into `log_path`.

    Runs in its own process group, so stopping it also stops anything it started, and is told this
    process's pid (HYBRIDSERVE_PARENT_PID): a hybridserve service stops by itself once the process
    that started it is gone, even SIGKILLed (services/lifetime.py), so a killed test run leaves no
    engine behind.
    """

    def __init__(self, module: str, env: dict[str, str], log_path: Path, args: tuple[str, ...] = ()):
        self.module, self.env, self.log_path, self.args = module, env, Path(log_path), args
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> "Process":
        from services.lifetime import launch_env

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=ROOT,
                                     env={**os.environ, **self.env, **launch_env()}, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_until(self, probe: Callable[[], bool], timeout: float, what: str, interval: float = 0.3) -> None:
        """Poll `probe` until it passes; RuntimeError if the process exits first, TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited with {self.proc.returncode} before {what}:\n"
                                   f"{self.log_tail()}")
            if probe():
                return
            time.sleep(interval)
        raise TimeoutError(f"{self.module}: not {what} after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        """`sig`, then SIGKILL to the whole group if it has not exited within `timeout`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
