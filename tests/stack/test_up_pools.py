"""`hybridserve up --prefill 2 --decode 2`: pools, every prefill engine feeding every decode engine.

Checked with real processes on loopback: four engines and the gateway start; the gateway sees the four
(prefill, decode) combinations as pairs; hybrid requests spread over both prefill and both decode
engines, each decode engine pulling its KV from the prefill engine the gateway named (also the one that
is not its own: each prefill engine ran exactly the hand-offs of the pairs naming it), and give gpu
mode's greedy tokens; nothing is left running.
"""
from __future__ import annotations

import re
import threading
import urllib.request

import pytest

from harness.stack import start_stack
from services.decode_fpga.settings import DecodeSettings
from services.prefill_gpu.settings import PrefillSettings
from services.stack import UpSettings
from tests.stack.test_up_heals import alive, http_json, module_children

PROMPT = "The capital of France is"
REQUESTS = 8


def prefill_requests(stack, i: int) -> float:
    """Prefills prefill engine i computed (its Prefill calls for hybrid mode, and gpu mode's), counted
    before the first token goes out (a finished-request count may miss a call the reader ends at once)."""
    url = f"http://127.0.0.1:{stack.pair_port('prefill_metrics', i)}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.search(r'^hybridserve_stage_seconds_count\{device="gpu",stage="prefill"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow
def test_two_prefill_engines_feed_two_decode_engines_each_request_on_the_prefill_named(tmp_path, profile_cache):
    env = {"HYBRIDSERVE_PROFILE_AT_START": "false", "HYBRIDSERVE_PROFILE_CACHE": str(profile_cache),
           UpSettings.env_name("prefill_engines"): "2", UpSettings.env_name("decode_engines"): "2",
           PrefillSettings.env_name("arena_bytes"): str(32 << 20),
           PrefillSettings.env_name("kv_cache_mb"): "96", DecodeSettings.env_name("kv_cache_mb"): "96",
           DecodeSettings.env_name("max_context"): "512"}
    stack = start_stack(tmp_path / "up.log", env, timeout=600, engines_per_kind=2)
    up_pid = stack.process.proc.pid
    try:
        status, _, health = http_json(stack.url + "/health")
        assert status == 200 and set(health["engines"]) == {f"{e}@{p}" for e in ("prefill_gpu", "decode_fpga")
                                                            for p in range(4)}
        model = http_json(stack.url + "/v1/models")[2]["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reference = http_json(stack.url + "/v1/completions", {**body, "mode": "gpu"})[2]["choices"][0]["text"]
        before = [prefill_requests(stack, i) for i in (0, 1)]
        results: list = [None] * REQUESTS

        def one(i: int) -> None:  # at once, so the least-loaded choice spreads them over the four pairs
            status, headers, reply = http_json(stack.url + "/v1/completions", {**body, "mode": "hybrid"})
            results[i] = (status, int(headers.get("x-hybridserve-pair", -1)), reply)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert all(r is not None and r[0] == 200 for r in results), results
        pairs = [r[1] for r in results]  # pair = prefill index x 2 + decode index (prefill-major)
        assert {p // 2 for p in pairs} == {0, 1} and {p % 2 for p in pairs} == {0, 1}, pairs
        assert {r[2]["choices"][0]["text"] for r in results} == {reference}
        assert all(r[2]["hybridserve"]["timings"]["handoff_bytes"] > 0 for r in results)
        # each prefill engine prefilled for exactly the requests whose pair named it, (p1, d0) included,
        # where decode_fpga.0 would have asked its own prefill_gpu.0 had the gateway not named one
        after = [prefill_requests(stack, i) for i in (0, 1)]
        assert [a - b for a, b in zip(after, before)] == [sum(p // 2 == i for p in pairs) for i in (0, 1)], pairs
        children = [name for name, _ in module_children(up_pid)]
        assert sorted(children) == ["services.decode_fpga", "services.decode_fpga", "services.gateway",
                                    "services.prefill_gpu", "services.prefill_gpu"]
        pids = [pid for _, pid in module_children(up_pid)]
    finally:
        stack.stop()
    assert stack.process.proc.returncode == 0 and not any(alive(p) for p in pids)
