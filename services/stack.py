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

from pydantic import SecretStr

from services.settings import CommonSettings


class StackSettings(CommonSettings):
    host: str = "127.0.0.1"
    gateway_port: int = 8000
    prefill_port: int = 50061
    prefill_metrics_port: int = 9101
    decode_port: int = 50062
    decode_metrics_port: int = 9102
    startup_timeout_s: float = 900.0
    api_key: SecretStr | None = None  # the gateway's, to ask it which model it serves


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
    s = StackSettings()
    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    children = {
        "prefill_gpu": ("services.prefill_gpu", {"HYBRIDSERVE_PORT": s.prefill_port,
                                                 "HYBRIDSERVE_METRICS_PORT": s.prefill_metrics_port}),
        "decode_fpga": ("services.decode_fpga", {"HYBRIDSERVE_PORT": s.decode_port,
                                                 "HYBRIDSERVE_METRICS_PORT": s.decode_metrics_port,
                                                 "HYBRIDSERVE_PREFILL_ADDRESS": f"{s.host}:{s.prefill_port}"}),
        "gateway": ("services.gateway", {"HYBRIDSERVE_PREFILL_ADDRESS": f"{s.host}:{s.prefill_port}",
                                         "HYBRIDSERVE_DECODE_ADDRESS": f"{s.host}:{s.decode_port}",
                                         "HYBRIDSERVE_GATEWAY_PORT": s.gateway_port}),
    }
    quiet = threading.Event()
    procs: dict[str, subprocess.Popen] = {}
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting the stack on {s.host}: prefill_gpu :{s.prefill_port}, decode_fpga :{s.decode_port}, "
          f"gateway :{s.gateway_port} (first start profiles each engine; later starts use the cache)", flush=True)
    try:
        for name, (module, env) in children.items():
            env = {**base, "HYBRIDSERVE_HOST": s.host, **{k: str(v) for k, v in env.items()}}
            procs[name] = subprocess.Popen([sys.executable, "-m", module], env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            threading.Thread(target=_relay, args=(name, procs[name], quiet), daemon=True).start()
        url = f"http://{s.host}:{s.gateway_port}"
        deadline = time.monotonic() + s.startup_timeout_s
        while not _healthy(url + "/health"):
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead or stop.is_set() or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else ("interrupted" if stop.is_set() else "timed out")
                print(f"hybridserve up: the stack did not come up ({why})", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
        quiet.set()
        auth = {"Authorization": f"Bearer {s.api_key.get_secret_value()}"} if s.api_key else {}
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=auth), timeout=5) as r:
            model = json.load(r)["data"][0]["id"]
        key_header = "-H 'Authorization: Bearer $HYBRIDSERVE_API_KEY' " if s.api_key else ""
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
