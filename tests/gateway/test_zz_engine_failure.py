"""decode_fpga dies: auto requests fall back to gpu, hybrid gets 503, the gateway stays up.

Runs last in this package (file order): it kills the shared stack's decode_fpga.
"""
from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL


@pytest.mark.slow
def test_killing_decode_fpga_falls_back_to_gpu(stack, client):
    stack["decode"].stop(sig=signal.SIGKILL)
    time.sleep(0.5)
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    ext = r.model_extra["hybridserve"]
    assert (ext["mode"], ext["reason"]) == ("gpu", "fallback")
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"mode": "hybrid"})
    assert err.value.status_code == 503 and err.value.body["code"] == "engine_unavailable"
    health = httpx.get(stack["url"] + "/health")
    assert health.status_code == 503 and health.json()["engines"]["decode_fpga"] == "down"
    metrics = httpx.get(stack["url"] + "/metrics").text
    assert 'hybridserve_router_decisions_total{mode="gpu",reason="fallback"}' in metrics
    assert stack["gateway"].proc.poll() is None
