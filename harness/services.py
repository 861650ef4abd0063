"""The three services as real processes on free loopback ports, named by their own settings."""
from __future__ import annotations

import urllib.request
from pathlib import Path

from harness.process import Process, free_port, grpc_serving, http_ok


def _settings_class(module: str):
    """The settings class of a service module: it names the variables the harness sets."""
    from services.decode_fpga.settings import DecodeSettings
    from services.gateway.settings import GatewaySettings
    from services.prefill_gpu.settings import PrefillSettings

    return {"services.prefill_gpu": PrefillSettings, "services.decode_fpga": DecodeSettings,
            "services.gateway": GatewaySettings}[module]


class Service(Process):
    """One service on free ports, profiling left for later (tests do not wait for it).

    `env` holds the test's own variables; the ports and HYBRIDSERVE_PROFILE_AT_START are the harness's.
    """

    def __init__(self, module: str, env: dict[str, str], log_path: Path):
        super().__init__(module, dict(env), log_path)
        self.port, self.metrics_port = free_port(), free_port()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch_env(self) -> dict[str, str]:
        """The variables it starts with: no profiling at start unless the test says otherwise, the test's
        own, then this Service's ports (always: a Service made from another's env gets ports of its own)."""
        settings = _settings_class(self.module)
        named = lambda d: {settings.env_name(f): str(v) for f, v in d.items() if f in settings.model_fields}  # noqa: E731
        return {**named({"profile_at_start": "false"}), **self.env,
                **named({"port": self.port, "metrics_port": self.metrics_port})}

    def start(self) -> "Service":
        self.env = self.launch_env()
        super().start()
        return self

    def wait_healthy(self, timeout: float = 120.0) -> "Service":
        """Until the engine's gRPC health check says SERVING."""
        self.wait_until(grpc_serving(self.address), timeout, "healthy")
        return self

    def metric(self, name: str) -> float:
        """The value of an unlabelled (or first labelled) sample on the engine's /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def engine_pair(tmp: Path, prefill_env: dict | None = None, decode_env: dict | None = None,
                profile_cache: Path | None = None):
    """prefill_gpu and decode_fpga, wired to each other, started in parallel (not yet waited for); their
    start-up profiles cached in `profile_cache` (one several pairs share skips the sweeps that an earlier
    pair could cache), else in a folder of their own under `tmp`."""
    from services.decode_fpga.settings import DecodeSettings
    from services.prefill_gpu.settings import PrefillSettings

    cache = {PrefillSettings.env_name("profile_cache"): str(profile_cache or tmp / "profile")}
    prefill = Service("services.prefill_gpu", {**cache, **(prefill_env or {})}, tmp / "prefill.log").start()
    decode = Service("services.decode_fpga", {**cache, DecodeSettings.env_name("prefill_address"): prefill.address,
                                              **(decode_env or {})}, tmp / "decode.log").start()
    return prefill, decode


def start_gateway(tmp: Path, prefill: Service, decode: Service, env: dict | None = None) -> Service:
    """The gateway in front of a started engine pair (not yet waited for: see wait_http_ok)."""
    from services.gateway.settings import GatewaySettings

    wiring = {GatewaySettings.env_name("prefill_address"): prefill.address,
              GatewaySettings.env_name("decode_address"): decode.address,
              GatewaySettings.env_name("log_level"): "WARNING"}
    return Service("services.gateway", {**wiring, **(env or {})}, tmp / "gateway.log").start()


def wait_http_ok(svc: Service, path: str = "/health", timeout: float = 400.0) -> None:
    """Until http://127.0.0.1:<svc.port><path> answers 200 (a gateway's /health: ready, so calibrated too:
    with a cold profile cache the engines' sweeps come first)."""
    svc.wait_until(http_ok(f"http://127.0.0.1:{svc.port}{path}"), timeout, f"answering {path}")
