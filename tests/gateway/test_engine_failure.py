"""decode_fpga dies: auto requests fall back to gpu, hybrid gets 503, the gateway stays up.

The test kills an engine, so it starts its own stack rather than sharing the package's.
"""
from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from services.decode_fpga.settings import DecodeSettings
from services.prefill_gpu.settings import PrefillSettings
from tests.services_harness import engine_pair, start_gateway, wait_http_ok


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory, profile_cache):
    tmp = tmp_path_factory.mktemp("engine_failure")
    prefill, decode = engine_pair(tmp, {PrefillSettings.env_name("arena_bytes"): str(32 << 20)},
                                  {DecodeSettings.env_name("max_context"): "1024",
                                   DecodeSettings.env_name("max_sequences"): "2"}, profile_cache)
    gateway = start_gateway(tmp, prefill, decode)
    try:
        # start-up (model load, kernel build) takes minutes when other work holds the two cores
        prefill.wait_healthy(timeout=420)
        decode.wait_healthy(timeout=420)
        wait_http_ok(gateway)  # 200 once the gateway sees both engines up
        url = f"http://127.0.0.1:{gateway.port}"
        yield {"decode": decode, "gateway": gateway, "url": url,
               "model": httpx.get(url + "/v1/models").json()["data"][0]["id"]}
    finally:
        gateway.stop()
        decode.stop()
        prefill.stop()


@pytest.mark.slow
def test_killing_decode_fpga_falls_back_to_gpu(own_stack):
    client = openai.OpenAI(base_url=own_stack["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = own_stack["model"]
    own_stack["decode"].stop(sig=signal.SIGKILL)
    # the gateway's health loop notices within its interval; until then an auto request may still
    # pick gpu on its own merits ("auto"), which says nothing about the fallback (the dispatcher's
    # retry on a failed call is covered by test_dispatch.py)
    deadline = time.monotonic() + 30
    while httpx.get(own_stack["url"] + "/health").json()["engines"]["decode_fpga"] != "down":
        assert time.monotonic() < deadline, "the gateway did not notice decode_fpga's death in 30 s"
        time.sleep(0.2)
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    ext = r.model_extra["hybridserve"]
    assert (ext["mode"], ext["reason"]) == ("gpu", "fallback")
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"mode": "hybrid"})
    assert err.value.status_code == 503 and err.value.body["code"] == "engine_unavailable"
    health = httpx.get(own_stack["url"] + "/health")
    assert health.status_code == 503 and health.json()["engines"]["decode_fpga"] == "down"
    metrics = httpx.get(own_stack["url"] + "/metrics").text
    assert 'hybridserve_router_decisions_total{mode="gpu",reason="fallback"}' in metrics
    assert own_stack["gateway"].proc.poll() is None
