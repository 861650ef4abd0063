"""The whole stack through `hybridserve up` on free ports, for benchmarks that need all three services."""
from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.process import Process, free_port, http_ok


@dataclass
class Stack:
    process: Process
    ports: dict[str, int]  # prefill, prefill_metrics, decode, decode_metrics, gateway, up_metrics

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    @property
    def prefill_address(self) -> str:
        return f"127.0.0.1:{self.ports['prefill']}"

    @property
    def decode_address(self) -> str:
        return f"127.0.0.1:{self.ports['decode']}"

    def stop(self) -> None:
        # `up` stops its three children on SIGTERM; the group kill is for a stack that hangs
        self.process.stop(signal.SIGTERM, timeout=60)


def start_stack(log_path: Path, extra_env: dict | None = None, timeout: float = 900,
                progress=lambda msg: print(msg, file=sys.stderr, flush=True)) -> Stack:
    """`hybridserve up` with every port free, once its gateway's /health answers 200."""
    from services.decode_fpga.settings import DecodeSettings
    from services.gateway.settings import GatewaySettings
    from services.prefill_gpu.settings import PrefillSettings
    from services.stack import UpSettings

    ports = {name: free_port() for name in ("prefill", "prefill_metrics", "decode", "decode_metrics", "gateway",
                                            "up_metrics")}
    env = {PrefillSettings.env_name("port"): ports["prefill"],
           PrefillSettings.env_name("metrics_port"): ports["prefill_metrics"],
           DecodeSettings.env_name("port"): ports["decode"],
           DecodeSettings.env_name("metrics_port"): ports["decode_metrics"],
           GatewaySettings.env_name("port"): ports["gateway"],
           UpSettings.env_name("metrics_port"): ports["up_metrics"]}
    env = {**{k: str(v) for k, v in env.items()}, **(extra_env or {})}
    stack = Stack(Process("services.cli", env, log_path, args=("up",)).start(), ports)
    progress(f"starting the stack (log: {log_path})")
    try:
        stack.process.wait_until(http_ok(stack.url + "/health"), timeout, "up", interval=1.0)
    except BaseException:
        stack.stop()
        raise
    progress(f"stack up at {stack.url}")
    return stack
