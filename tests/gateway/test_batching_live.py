"""Continuous batching on the live stack: many streaming clients at once, some of whom walk away.

Every request that finishes gets exactly the tokens it gets alone (batch invariance through
the whole stack, in every mode); afterwards every KV block is back in both engines, no
request is left running, and the engines hold no more threads than before the burst.
"""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

import pytest

from services.modes import MODE_NAMES
from tests.gateway.conftest import API_KEY, MODEL, wait_calibrated
from tests.services_harness import engine_pair, start_gateway, wait_http_ok

pytestmark = pytest.mark.slow

N_CLIENTS = 16
WALK_AWAY = {3, 7, 11, 14}  # these clients close their stream after two chunks


def stream_completion(url: str, prompt: str, mode: str, max_tokens: int,
                      stop_after: int | None = None) -> tuple[str, int]:
    """(text, completion tokens) of one streamed greedy completion; stop_after: hang up after that many
    text pieces (the tokens are then the pieces seen)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "mode": mode, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    pieces, tokens = [], 0
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                pieces.append(chunk["choices"][0]["text"])
            if stop_after is not None and len(pieces) >= stop_after:
                return "".join(pieces), len(pieces)  # closing the response hangs up mid-stream
    return "".join(pieces), tokens


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def wait_idle(service, timeout: float = 60.0) -> tuple[float, float]:
    """Until the engine reports nothing running; its (running, kv usage) then."""
    deadline = time.monotonic() + timeout
    while True:
        state = (service.metric("hybridserve_engine_num_requests_running"),
                 service.metric("hybridserve_engine_kv_cache_usage_ratio"))
        if state == (0.0, 0.0) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


@pytest.fixture(scope="module")
def batching_stack(tmp_path_factory, profile_cache):
    """A stack of its own with the batching defaults (the package's stack batches only two gpu-mode
    requests, for its 429 test), on small KV pools."""
    tmp = tmp_path_factory.mktemp("batching")
    prefill, decode = engine_pair(tmp, {"HYBRIDSERVE_PREFILL_KV_CACHE_MB": "256"},
                                  {"HYBRIDSERVE_DECODE_KV_CACHE_MB": "256", "HYBRIDSERVE_DECODE_MAX_CONTEXT": "2048"},
                                  profile_cache)
    gateway = start_gateway(tmp, prefill, decode, {"HYBRIDSERVE_API_KEY": API_KEY})
    try:
        prefill.wait_healthy(timeout=420)
        decode.wait_healthy(timeout=420)
        wait_http_ok(gateway)
        wait_calibrated(f"http://127.0.0.1:{gateway.port}")
        yield {"prefill": prefill, "decode": decode, "url": f"http://127.0.0.1:{gateway.port}"}
    finally:
        gateway.stop()
        decode.stop()
        prefill.stop()


def test_sixteen_streams_some_walk_away_all_blocks_come_back(batching_stack):
    url, engines = batching_stack["url"], (batching_stack["prefill"], batching_stack["decode"])
    prompts = [f"Request {i}: tell me about the number {i * 7} in one sentence." for i in range(N_CLIENTS)]
    modes = [MODE_NAMES[i % len(MODE_NAMES)] for i in range(N_CLIENTS)]
    alone = {i: stream_completion(url, prompts[i], modes[i], 24)[0] for i in range(len(MODE_NAMES) * 2)}
    for svc in engines:
        wait_idle(svc)
    threads_before = [threads_of(svc.proc.pid) for svc in engines]

    results = burst(url, prompts, modes)
    errors = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert not errors and len(results) == N_CLIENTS
    for i, (text, tokens) in results.items():
        if i in WALK_AWAY:
            assert tokens == 2
        else:
            assert tokens == 24
            if i in alone:  # the same tokens as alone, whatever else ran beside it
                assert text == alone[i], (i, modes[i])
    for svc in engines:
        assert wait_idle(svc) == (0.0, 0.0), svc.module
        assert svc.metric("hybridserve_engine_num_requests_waiting") == 0.0
    # gRPC's pool keeps idle workers, so a burst may add threads up to the most calls it ever held at
    # once (a later burst that happens to overlap more adds a few more); what must not happen is growth
    # with every burst: a thread per request left behind would add one per request each time
    counts = [[threads_of(svc.proc.pid) for svc in engines]]
    assert all(after <= before + N_CLIENTS + 8 for before, after in zip(threads_before, counts[0]))
    for _ in range(2):
        again = burst(url, prompts, modes)
        assert not [r for r in again.values() if isinstance(r, Exception)]
        for svc in engines:
            assert wait_idle(svc) == (0.0, 0.0), svc.module
        counts.append([threads_of(svc.proc.pid) for svc in engines])
    for engine, (first, second, third) in zip(("prefill_gpu", "decode_fpga"), zip(*counts)):
        # a thread left per request would add N_CLIENTS a burst
        assert second <= first + N_CLIENTS // 2 and third <= second + N_CLIENTS // 2, (engine, first, second, third)


def burst(url: str, prompts: list[str], modes: list[str]) -> dict[int, object]:
    """Every client at once; each one's pieces, or the exception it got."""
    results: dict[int, object] = {}

    def client(i: int) -> None:
        try:
            results[i] = stream_completion(url, prompts[i], modes[i], 24, 2 if i in WALK_AWAY else None)
        except Exception as exc:  # reported by the caller, with the client's number
            results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results
