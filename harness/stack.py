"""The whole stack through `hybridserve up` on free ports, for benchmarks that need all three services
(or, with `pairs`, several engine pairs behind the one gateway)."""
from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.process import Process, free_port, free_strided_ports, http_ok


@dataclass
class Stack:
    process: Process
    ports: dict[str, int]  # prefill, prefill_metrics, decode, decode_metrics, gateway, up_metrics (pair 0)
    pairs: int = 1
    port_stride: int = 10  # pair i's engine ports: pair 0's + i x port_stride

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    @property
    def prefill_address(self) -> str:
        return f"127.0.0.1:{self.ports['prefill']}"

    @property
    def decode_address(self) -> str:
        return f"127.0.0.1:{self.ports['decode']}"

    def pair_port(self, name: str, pair: int) -> int:
        """`name` (prefill, decode, ..._metrics) of pair `pair`."""
        return self.ports[name] + pair * self.port_stride

    def wait_up(self, timeout: float = 900) -> "Stack":
        """Until `up` says the stack is up (its gateway's /health answers 200 and the router is
        calibrated), as a user of `make run` would wait; the stack is stopped if it never is."""
        log_path = self.process.log_path
        try:
            self.process.wait_until(http_ok(self.url + "/health"), timeout, "up", interval=1.0)
            self.process.wait_until(lambda: "hybridserve is up" in log_path.read_text(errors="replace"), timeout,
                                    "calibrated", interval=1.0)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # `up` stops its three children on SIGTERM; the group kill is for a stack that hangs
        self.process.stop(signal.SIGTERM, timeout=60)


def launch_stack(log_path: Path, extra_env: dict | None = None, pairs: int = 1, port_stride: int = 10,
                 engines_per_kind: int | None = None) -> Stack:
    """`hybridserve up [--pairs N]` with every port free, started (see Stack.wait_up)."""
    from services.decode_fpga.settings import DecodeSettings
    from services.gateway.settings import GatewaySettings
    from services.prefill_gpu.settings import PrefillSettings
    from services.launcher.stack import UpSettings

    # engines_per_kind: the most engines of one kind (pools, `up --prefill N --decode M`: M), each a stride apart
    strided = engines_per_kind or pairs
    ports = {name: free_strided_ports(port_stride, strided) if name.startswith(("prefill", "decode")) else free_port()
             for name in ("prefill", "prefill_metrics", "decode", "decode_metrics", "gateway", "up_metrics")}
    env = {PrefillSettings.env_name("port"): ports["prefill"],
           PrefillSettings.env_name("metrics_port"): ports["prefill_metrics"],
           DecodeSettings.env_name("port"): ports["decode"],
           DecodeSettings.env_name("metrics_port"): ports["decode_metrics"],
           GatewaySettings.env_name("port"): ports["gateway"],
           UpSettings.env_name("metrics_port"): ports["up_metrics"],
           UpSettings.env_name("port_stride"): port_stride}
    env = {**{k: str(v) for k, v in env.items()}, **(extra_env or {})}
    args = ("up",) if pairs == 1 else ("up", "--pairs", str(pairs))
    return Stack(Process("services.launcher.cli", env, log_path, args=args).start(), ports, pairs, port_stride)


def start_stack(log_path: Path, extra_env: dict | None = None, timeout: float = 900,
                progress=lambda msg: print(msg, file=sys.stderr, flush=True), pairs: int = 1,
                port_stride: int = 10, engines_per_kind: int | None = None) -> Stack:
    """`hybridserve up [--pairs N]` with every port free, once it says it is up."""
    stack = launch_stack(log_path, extra_env, pairs, port_stride, engines_per_kind)
    progress(f"starting the stack (log: {log_path})")
    stack.wait_up(timeout)
    progress(f"stack up at {stack.url}")
    return stack
