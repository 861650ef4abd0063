"""`hybridserve up` with the KV over NIXL (HYBRIDSERVE_DECODE_KV_TRANSPORT=nixl) on loopback (UCX pinned to
`lo`), two pairs: a greedy hybrid request gives the tokens of the gpu and fpga modes (the same as over
shm and tcp, which give those too: tests/stack/test_hybrid.py, test_hybrid_tcp.py); then the decode_fpga
a hybrid request's KV is going to is SIGKILLed while its hand-off is open (the control connection to
its KV port established, before the request's first token) and the gateway carries the request to the
other pair, in hybrid mode as the client forced: the client's text is the uninterrupted run's, nothing
lost, nothing twice; `up` starts the killed engine again and hybrid serves over NIXL again."""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import threading

import pytest

from harness.stack import start_stack
from services.decode_fpga.settings import DecodeSettings
from services.prefill_gpu.settings import PrefillSettings
from services.launcher.stack import UpSettings
from tests.stack.test_up_heals import healthy, http_json, wait_for
from tests.stack.test_up_pairs import _decode_pid

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None,
                                 reason="the nixl extra is not installed (pip install 'hybridserve[nixl]')")]

PROMPT = "The capital of France is"
LONG_PROMPT = " ".join(["The history of the printing press begins in the fifteenth century."] * 60)  # ~800 tokens
ESTABLISHED = "01"


def complete(url: str, model: str, prompt: str, mode: str, max_tokens: int) -> tuple[dict, dict]:
    status, headers, body = http_json(url + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "mode": mode})
    assert status == 200, body
    return headers, body


def kv_connections(port: int) -> int:
    """Established TCP connections to local `port` (the KV inbox's control connections)."""
    n = 0
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, _, state = line.split()[1:4]
        n += int(local.split(":")[1], 16) == port and state == ESTABLISHED
    return n


def kv_ports(log_text: str) -> dict[int, int]:
    """KV port -> pair, from each decode_fpga's start-up line."""
    found = re.findall(r"\[decode_fpga(?:\.(\d+))?\] .*KV over nixl: listening on \('127\.0\.0\.1', (\d+)\), "
                       r"prefill_gpu connects to nixl://", log_text)
    return {int(port): int(pair or 0) for pair, port in found}


def test_hybrid_over_nixl_matches_the_other_modes_and_survives_decode_killed_mid_handoff(tmp_path, profile_cache):
    env = {"HYBRIDSERVE_PROFILE_AT_START": "false", "HYBRIDSERVE_PROFILE_CACHE": str(profile_cache),
           UpSettings.env_name("restart_backoff_s"): "0.5", PrefillSettings.env_name("arena_bytes"): str(32 << 20),
           PrefillSettings.env_name("kv_cache_mb"): "128", DecodeSettings.env_name("kv_cache_mb"): "128",
           DecodeSettings.env_name("max_context"): "1024", DecodeSettings.env_name("max_sequences"): "2",
           DecodeSettings.env_name("kv_transport"): "nixl", PrefillSettings.env_name("kv_transport"): "nixl",
           "UCX_NET_DEVICES": "lo"}
    log = tmp_path / "up.log"
    stack = start_stack(log, env, timeout=600, pairs=2)
    up_pid = stack.process.proc.pid
    try:
        ports = kv_ports(log.read_text())
        assert sorted(ports.values()) == [0, 1], f"each decode_fpga opens its NIXL KV port: {ports}"
        model = http_json(stack.url + "/v1/models")[2]["data"][0]["id"]
        headers, hybrid = complete(stack.url, model, PROMPT, "hybrid", 12)
        assert headers.get("x-hybridserve-mode") == "hybrid"
        texts = {mode: complete(stack.url, model, PROMPT, mode, 12)[1]["choices"][0]["text"] for mode in ("gpu", "fpga")}
        assert hybrid["choices"][0]["text"] == texts["gpu"] == texts["fpga"]

        # the decode_fpga a long prompt's KV goes to (no prefix of it cached anywhere), killed while that
        # hand-off is open: from prefill's admission of it to decode's OK, its control connection is up
        result, open_on = {}, []
        request = threading.Thread(target=lambda: result.update(
            zip(("headers", "body"), complete(stack.url, model, LONG_PROMPT, "hybrid", 16))))
        request.start()
        wait_for(lambda: open_on.extend(p for p in ports if kv_connections(p)) or open_on,
                 "a hand-off's control connection", 120)
        pair = ports[open_on[0]]
        victim = _decode_pid(stack, up_pid, pair)
        os.kill(victim, signal.SIGKILL)
        request.join(300)
        assert "body" in result, "the request failed"
        served, body = result["headers"], result["body"]
        assert served["x-hybridserve-mode"] == "hybrid" and int(served["x-hybridserve-pair"]) != pair
        again = complete(stack.url, model, LONG_PROMPT, "gpu", 16)[1]["choices"][0]["text"]
        assert body["choices"][0]["text"] == again and body["usage"]["completion_tokens"] == 16  # none lost or twice

        # `up` brings the killed engine back; its pair serves hybrid over NIXL again, with the same tokens
        wait_for(lambda: _decode_pid(stack, up_pid, pair) not in (None, victim), "a new decode_fpga", 120)
        wait_for(lambda: healthy(stack.url), "the gateway healthy again", 600)
        assert f"decode_fpga.{pair} exited (killed by SIGKILL)" in log.read_text()
        headers, after = complete(stack.url, model, PROMPT, "hybrid", 12)
        assert headers.get("x-hybridserve-mode") == "hybrid" and after["choices"][0]["text"] == texts["gpu"]
    finally:
        stack.stop()
