"""`hybridserve up` keeps the stack running: real processes on free ports, an engine SIGKILLed.

Before, `up` stopped all three processes when one exited. Now the gateway SIGKILLed while `up` waits
for the router's calibration is started again, and `up` still says when the stack is up; a dead
engine is started again (counted on `up`'s metrics port), the gateway serves a hybrid completion
through it, and SIGTERM stops every child with nothing left behind. The stack runs with a shared
engine token: the hybrid completion also shows that the gateway and decode_fpga send it.
"""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from harness.stack import launch_stack
from services.decode_fpga.settings import DecodeSettings
from services.kv.arena import SHM_DIR
from services.prefill_gpu.settings import PrefillSettings
from services.rpc.engine_token import engine_channel
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc
from services.launcher.stack import UpSettings

TOKEN = "stack-engine-token"


def module_children(pid: int) -> list[tuple[str, int]]:
    """(module, pid) of each of `pid`'s `python -m <module>` children."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"-m" in argv:
            found.append((argv[argv.index(b"-m") + 1].decode(), int(entry.name)))
    return found


def children_of(pid: int) -> dict[str, int]:
    """module → pid of `pid`'s `python -m services.<x>` children (one per module)."""
    return dict(module_children(pid))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(probe, what: str, within: float) -> None:
    deadline = time.monotonic() + within
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"never {what}")
        time.sleep(1.0)


def http_json(url: str, body: dict | None = None) -> tuple[int, dict, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), {}


def healthy(url: str) -> bool:
    try:
        return http_json(url + "/health")[0] == 200
    except OSError:
        return False


@pytest.mark.slow
def test_a_killed_engine_comes_back_and_sigterm_leaves_nothing(tmp_path):
    env = {"HYBRIDSERVE_ENGINE_TOKEN": TOKEN, "HYBRIDSERVE_PROFILE_AT_START": "false",
           "HYBRIDSERVE_PROFILE_CACHE": str(tmp_path / "profile"), UpSettings.env_name("restart_backoff_s"): "0.5",
           PrefillSettings.env_name("arena_bytes"): str(32 << 20),
           DecodeSettings.env_name("max_context"): "512", DecodeSettings.env_name("max_sequences"): "2"}
    log = tmp_path / "up.log"
    stack = launch_stack(log, env)
    up_pid = stack.process.proc.pid
    try:
        # the gateway SIGKILLed while `up` waits for the router's calibration (the engines' first
        # profile sweeps): `up` starts it again and says the stack is up once it is, where it used to
        # die on its ready announcement (URLError) and take the stack down
        stack.process.wait_until(lambda: "calibrating the router" in log.read_text(), 600,
                                 "waiting for the router's calibration", interval=0.1)
        assert "hybridserve is up" not in log.read_text()
        os.kill(children_of(up_pid)["services.gateway"], signal.SIGKILL)
        stack.wait_up(600)
        assert "gateway exited (killed by SIGKILL)" in log.read_text() and "Traceback" not in log.read_text()
        first = children_of(up_pid)
        assert set(first) == {"services.prefill_gpu", "services.decode_fpga", "services.gateway"}
        with engine_channel(stack.prefill_address, TOKEN) as ch:
            arena = pb_grpc.EngineStub(ch).Info(pb.InfoRequest(), timeout=10).arena_name
        with grpc.insecure_channel(stack.prefill_address) as ch, pytest.raises(grpc.RpcError) as err:
            pb_grpc.EngineStub(ch).Info(pb.InfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the stack's engines ask for the token

        os.kill(first["services.decode_fpga"], signal.SIGKILL)
        wait_for(lambda: children_of(up_pid).get("services.decode_fpga", first["services.decode_fpga"])
                 != first["services.decode_fpga"], "a new decode_fpga", 120)
        wait_for(lambda: healthy(stack.url), "the gateway healthy again", 600)
        now = children_of(up_pid)
        assert now["services.prefill_gpu"] == first["services.prefill_gpu"]  # only the dead one restarted
        assert now["services.gateway"] == first["services.gateway"]

        model = http_json(stack.url + "/v1/models")[2]["data"][0]["id"]
        status, headers, body = http_json(stack.url + "/v1/completions", {
            "model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "mode": "hybrid"})
        assert status == 200, body
        assert headers.get("x-hybridserve-mode") == "hybrid" and body["choices"][0]["text"]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack.ports['up_metrics']}/metrics", timeout=5).read()
        assert b'hybridserve_engine_restarts_total{service="decode_fpga"} 1.0' in metrics
        assert "decode_fpga exited (killed by SIGKILL)" in log.read_text()
    finally:
        pids = list(children_of(up_pid).values())
        stack.stop()  # SIGTERM to `up`
    assert stack.process.proc.returncode == 0
    assert pids and not any(alive(p) for p in pids)
    assert not (SHM_DIR / arena).exists()
