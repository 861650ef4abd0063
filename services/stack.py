"""`hybridserve up`: the whole local stack (prefill_gpu, decode_fpga, gateway) from one command.

Starts the three processes, relays their start-up progress (model load, kernel
build, profiling), waits until the gateway's /health says both engines answer,
prints where to send requests, and on Ctrl-C or SIGTERM stops all three.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import ClassVar

from services.decode_fpga.settings import DecodeSettings
from services.gateway.settings import GatewaySettings
from services.prefill_gpu.settings import PrefillSettings
from services.settings import CommonSettings

# the fields `up` always chooses per child itself; their old shared names (HYBRIDSERVE_PORT, ...)
# never reached a child from `up`, so they do not count here either
_CHOSEN_PER_CHILD = ("port", "metrics_port", "prefill_address", "decode_address")


class UpSettings(CommonSettings):
    """`hybridserve up`'s own settings; the children's ports are their own (HYBRIDSERVE_PREFILL_PORT, ...)."""

    service: ClassVar[str] = "hybridserve up"
    own_prefix: ClassVar[str] = "HYBRIDSERVE_UP_"

    host: str = "127.0.0.1"
    startup_timeout_s: float = 900.0


def _children_environment() -> dict[str, str]:
    """The environment every child starts from: ours, less the old names `up` overrides per child."""
    overridden = {old for cls in (PrefillSettings, DecodeSettings, GatewaySettings)
                  for old, field in cls.old_env_names().items() if field in _CHOSEN_PER_CHILD}
    return {k: v for k, v in os.environ.items() if k.upper() not in overridden}


def _relay(name: str, proc: subprocess.Popen, quiet_after: threading.Event) -> None:
    for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        # the access log of a running stack is noise here; errors always show
        if '"GET /health' in line:
            continue  # our own readiness polling
        if not quiet_after.is_set() or "WARNING" in line or "ERROR" in line or "Traceback" in line:
            print(f"[{name}] {line}", flush=True)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def up() -> int:
    base = _children_environment()
    # read here as each child will, so a typo stops `up` before anything starts
    s, prefill, decode, gateway = (cls.from_environ(base) for cls in (UpSettings, PrefillSettings, DecodeSettings,
                                                                    GatewaySettings))
    base["PYTHONUNBUFFERED"] = "1"
    pin = lambda cls, **values: {cls.env_name(k): v for k, v in values.items()}  # noqa: E731
    children = {
        "prefill_gpu": ("services.prefill_gpu", pin(PrefillSettings, port=prefill.port,
                                                    metrics_port=prefill.metrics_port)),
        "decode_fpga": ("services.decode_fpga", pin(DecodeSettings, port=decode.port, metrics_port=decode.metrics_port,
                                                    prefill_address=f"{s.host}:{prefill.port}")),
        "gateway": ("services.gateway", pin(GatewaySettings, port=gateway.port,
                                            prefill_address=f"{s.host}:{prefill.port}",
                                            decode_address=f"{s.host}:{decode.port}")),
    }
    quiet = threading.Event()
    procs: dict[str, subprocess.Popen] = {}
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting the stack on {s.host}: prefill_gpu :{prefill.port}, decode_fpga :{decode.port}, "
          f"gateway :{gateway.port} (first start profiles each engine; later starts use the cache)", flush=True)
    try:
        for name, (module, env) in children.items():
            env = {**base, UpSettings.env_name("host"): s.host, **{k: str(v) for k, v in env.items()}}
            procs[name] = subprocess.Popen([sys.executable, "-m", module], env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            threading.Thread(target=_relay, args=(name, procs[name], quiet), daemon=True).start()
        url = f"http://{s.host}:{gateway.port}"
        deadline = time.monotonic() + s.startup_timeout_s
        while not _healthy(url + "/health"):
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead or stop.is_set() or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else ("interrupted" if stop.is_set() else "timed out")
                print(f"hybridserve up: the stack did not come up ({why})", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
        quiet.set()
        key = gateway.api_key
        auth = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=auth), timeout=5) as r:
            model = json.load(r)["data"][0]["id"]
        key_header = f"-H 'Authorization: Bearer ${GatewaySettings.env_name('api_key')}' " if key else ""
        print(f"\nhybridserve is up: {url}/v1  (OpenAI API; health {url}/health, metrics {url}/metrics)\n"
              f"try:\n  curl {url}/v1/chat/completions {key_header}-H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": "
              f"\"What is the capital of France?\"}}], \"max_tokens\": 32, \"temperature\": 0}}'\n"
              f"Ctrl-C stops all three processes.", flush=True)
        while not stop.is_set():
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead:
                print(f"hybridserve up: {', '.join(dead)} exited; stopping the stack", file=sys.stderr, flush=True)
                return 1
            stop.wait(0.5)
        return 0
    finally:
        _stop_all(procs)


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    # the gateway first, so no new request reaches an engine that is going away
    for name in ("gateway", "decode_fpga", "prefill_gpu"):
        p = procs.get(name)
        if p and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    print("stopped", flush=True)
