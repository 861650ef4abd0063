"""`hybridserve up --prefill 1 --decode 2`: pools, one prefill engine feeding two decode engines.

Checked with real processes on loopback: three engines and the gateway start; the gateway sees two
pairs that share prefill_gpu.0; hybrid requests spread over both decode engines (each pulling its
KV from the one prefill engine's arena) and give gpu mode's greedy tokens; nothing is left running.
"""
from __future__ import annotations

import threading

import pytest

from harness.stack import start_stack
from services.decode_fpga.settings import DecodeSettings
from services.prefill_gpu.settings import PrefillSettings
from services.stack import UpSettings
from tests.stack.test_up_heals import alive, http_json, module_children

PROMPT = "The capital of France is"


@pytest.mark.slow
def test_one_prefill_engine_feeds_two_decode_engines(tmp_path):
    env = {"HYBRIDSERVE_PROFILE_AT_START": "false", "HYBRIDSERVE_PROFILE_CACHE": str(tmp_path / "profile"),
           UpSettings.env_name("prefill_engines"): "1", UpSettings.env_name("decode_engines"): "2",
           PrefillSettings.env_name("arena_bytes"): str(32 << 20),
           PrefillSettings.env_name("kv_cache_mb"): "128", DecodeSettings.env_name("kv_cache_mb"): "128",
           DecodeSettings.env_name("max_context"): "512"}
    stack = start_stack(tmp_path / "up.log", env, timeout=600, engines_per_kind=2)
    up_pid = stack.process.proc.pid
    try:
        status, _, health = http_json(stack.url + "/health")
        assert status == 200 and set(health["engines"]) == {"prefill_gpu@0", "decode_fpga@0", "prefill_gpu@1",
                                                            "decode_fpga@1"}
        model = http_json(stack.url + "/v1/models")[2]["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reference = http_json(stack.url + "/v1/completions", {**body, "mode": "gpu"})[2]["choices"][0]["text"]
        results: list = [None] * 6

        def one(i: int) -> None:  # at once, so the least-loaded choice spreads them over both decode engines
            status, headers, reply = http_json(stack.url + "/v1/completions", {**body, "mode": "hybrid"})
            results[i] = (status, int(headers.get("x-hybridserve-pair", -1)), reply)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert all(r is not None and r[0] == 200 for r in results), results
        assert {r[1] for r in results} == {0, 1}
        assert {r[2]["choices"][0]["text"] for r in results} == {reference}
        assert all(r[2]["hybridserve"]["timings"]["handoff_bytes"] > 0 for r in results)
        children = [name for name, _ in module_children(up_pid)]
        assert sorted(children) == ["services.decode_fpga", "services.decode_fpga", "services.gateway",
                                    "services.prefill_gpu"]
        pids = [pid for _, pid in module_children(up_pid)]
    finally:
        stack.stop()
    assert stack.process.proc.returncode == 0 and not any(alive(p) for p in pids)
