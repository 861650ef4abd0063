"""The whole stack as real processes on loopback, once for the gateway tests."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.services_harness import engine_pair, start_gateway, wait_http_ok

API_KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
# prefill_gpu batches two gpu-mode requests and queues none, so a burst gets 429s
# both engines speculate (n-gram drafts, services/engine/speculation.py): every API test on this stack then
# checks that drafts change no token, with logprobs, stops, grammars and n > 1 (test_api_speculation.py
# compares the same requests with speculation turned off per request)
# (up to 4 sequences decoding, the served default being 2, so that n > 1 drafts in a batch too)
SPECULATIVE_K = "4"
PREFILL_ENV = {"HYBRIDSERVE_PREFILL_MAX_NUM_SEQS": "2", "HYBRIDSERVE_QUEUE_DEPTH": "0",
               "HYBRIDSERVE_ARENA_BYTES": str(64 << 20), "HYBRIDSERVE_PREFILL_KV_CACHE_MB": "256",
               "HYBRIDSERVE_PREFILL_SPECULATIVE_K": SPECULATIVE_K, "HYBRIDSERVE_PREFILL_SPECULATIVE_MAX_BATCH": "4"}
PLANNER_WINDOW_S = 20.0
DECODE_ENV = {"HYBRIDSERVE_MAX_CONTEXT": "2048", "HYBRIDSERVE_MAX_SEQUENCES": "4",
              "HYBRIDSERVE_DECODE_KV_CACHE_MB": "512", "HYBRIDSERVE_DECODE_SPECULATIVE_K": SPECULATIVE_K,
              "HYBRIDSERVE_DECODE_SPECULATIVE_MAX_BATCH": "4"}


def wait_calibrated(url: str, timeout: float = 240.0) -> None:
    """Until the router has estimates for all three modes (both Profiles, hand-off samples included)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        req = urllib.request.Request(url + "/v1/completions", method="POST",
                                     data=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode(),
                                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            if set(json.load(r)["hybridserve"]["estimates"]) == {"gpu", "fpga", "hybrid"}:
                return
        time.sleep(1)
    raise TimeoutError("the router never got estimates for all three modes")


@pytest.fixture(scope="package")
def stack(tmp_path_factory, profile_cache):
    tmp = tmp_path_factory.mktemp("stack")
    prefill, decode = engine_pair(tmp, PREFILL_ENV, DECODE_ENV, profile_cache)
    # the planner keeps its default TTFT and ITL targets; its window is short so that test_api_planner.py
    # finds it clear of the tests before it within seconds
    gateway = start_gateway(tmp, prefill, decode, {"HYBRIDSERVE_API_KEY": API_KEY, "HYBRIDSERVE_MAX_BODY_BYTES": "200000",
                                                   "HYBRIDSERVE_GATEWAY_PLANNER_WINDOW_S": str(PLANNER_WINDOW_S)})
    try:
        # start-up (model load, profile sweep) takes minutes when other work holds the two cores
        prefill.wait_healthy(timeout=420)
        decode.wait_healthy(timeout=420)
        wait_http_ok(gateway)
        wait_calibrated(f"http://127.0.0.1:{gateway.port}")
        yield {"prefill": prefill, "decode": decode, "gateway": gateway, "url": f"http://127.0.0.1:{gateway.port}"}
    finally:
        gateway.stop()
        decode.stop()
        prefill.stop()


@pytest.fixture(scope="package")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack["url"] + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
