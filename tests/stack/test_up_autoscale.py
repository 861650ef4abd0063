"""`hybridserve up --prefill 1 --decode 1 --autoscale --max-decode 2`: the planner's signal starts and
stops a decode engine, within bounds, and its streams finish.

Real processes on loopback. The planner's targets are set so tight (TTFT and ITL of a microsecond) that
any load makes it want its most replicas, its window short (2 s) so the want falls back to 1 soon after
the load stops, and `up`'s holds and cooldown short (the hold down, 2 s, outlasts a slow request of the
load, so the engine being started is not stopped before it serves). Under load `up` starts decode_fpga.1 (only one: the
bound is 2; and no prefill engine: its bound is 1), which joins the gateway's pool once it answers
and serves hybrid requests (the gateway names it in `x-hybridserve-pair`), pulling its KV from
prefill_gpu.0. Then two long streams run, one on each decode engine, and the load stops: `up` drains
decode_fpga.1 while its stream is open, the stream runs to its last token (the same text as the other
engine's), and only then is the engine removed and its process stopped, its port free again.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from harness.process import port_is_free
from harness.stack import start_stack
from services.decode_fpga.settings import DecodeSettings
from services.gateway.settings import GatewaySettings
from services.prefill_gpu.settings import PrefillSettings
from services.stack import UpSettings
from tests.stack.test_up_heals import alive, http_json, module_children

LONG_TOKENS = 800  # a stream that outlives the planner's window and the drain's hold several times over


def stream(url: str, body: dict, out: dict) -> None:
    """A streaming completion: `out` gets its pair, text, tokens, finish reason and when it ended."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": True, "stream_options": {
        "include_usage": True}}).encode(), {"Content-Type": "application/json"})
    text, finish = [], None
    with urllib.request.urlopen(req, timeout=300) as r:
        out["pair"] = int(r.headers["x-hybridserve-pair"])
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
            for c in chunk.get("choices", []):
                text.append(c.get("text", ""))
                finish = c.get("finish_reason") or finish
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
    out.update(text="".join(text), finish=finish, ended=time.monotonic())


def pools(url: str) -> dict[str, list[dict]]:
    return http_json(url + "/debug/planner")[2]["pools"]


@pytest.mark.slow
def test_the_planner_adds_a_decode_engine_that_serves_then_drains_and_stops_it(tmp_path, profile_cache):
    env = {"HYBRIDSERVE_PROFILE_AT_START": "false", "HYBRIDSERVE_PROFILE_CACHE": str(profile_cache),
           UpSettings.env_name("prefill_engines"): "1", UpSettings.env_name("decode_engines"): "1",
           UpSettings.env_name("autoscale"): "true", UpSettings.env_name("max_decode_engines"): "2",
           UpSettings.env_name("autoscale_interval_s"): "0.25", UpSettings.env_name("scale_up_hold_s"): "0.5",
           UpSettings.env_name("scale_down_hold_s"): "2", UpSettings.env_name("scale_cooldown_s"): "1",
           GatewaySettings.env_name("planner_ttft_s"): "1e-6", GatewaySettings.env_name("planner_itl_s"): "1e-6",
           GatewaySettings.env_name("planner_window_s"): "2",
           PrefillSettings.env_name("arena_bytes"): str(32 << 20),
           PrefillSettings.env_name("kv_cache_mb"): "96", DecodeSettings.env_name("kv_cache_mb"): "96",
           DecodeSettings.env_name("max_context"): "1024"}
    log = tmp_path / "up.log"
    stack = start_stack(log, env, timeout=600, engines_per_kind=2)
    up_pid = stack.process.proc.pid
    new_address = f"127.0.0.1:{stack.pair_port('decode', 1)}"
    try:
        model = http_json(stack.url + "/v1/models")[2]["data"][0]["id"]
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "mode": "hybrid"}
        reference = http_json(stack.url + "/v1/completions", {**body, "mode": "gpu"})[2]["choices"][0]["text"]
        # ---- load: the planner wants more decode engines; `up` starts one, which serves -------------
        results, stop, sizes = [], threading.Event(), []

        def load() -> None:
            while not stop.is_set():
                status, headers, reply = http_json(stack.url + "/v1/completions", body)
                results.append((status, int(headers.get("x-hybridserve-pair", -1)),
                                reply.get("choices", [{}])[0].get("text")))
                stop.wait(0.1)  # a steady demand, leaving the cores to the engine being started
        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        deadline, new_pairs = time.monotonic() + 300, set()
        try:
            while not new_pairs & {pair for _, pair, _ in results}:
                assert time.monotonic() < deadline, "no request was served by a second decode engine"
                now = pools(stack.url)
                sizes.append((len(now["decode"]), len(now["prefill"])))
                new_pairs = {p for m in now["decode"] if m["address"] == new_address and m["up"] for p in m["pairs"]}
                time.sleep(0.25)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert results and all(status == 200 and text == reference for status, _, text in results), results
        # ---- two long streams, one per decode engine; the load is over: decode_fpga.1 drains ---------
        long_body = {**body, "prompt": "Once upon a time", "max_tokens": LONG_TOKENS}
        streams = [{}, {}]
        readers = [threading.Thread(target=stream, args=(stack.url, long_body, out)) for out in streams]
        for t in readers:
            t.start()
        seen_draining = None
        deadline = time.monotonic() + 120
        while seen_draining is None and time.monotonic() < deadline:
            now = pools(stack.url)
            member = next((m for m in now["decode"] if m["address"] == new_address), None)
            if member is None or member["draining"]:
                seen_draining = (time.monotonic(), member and member["calls_open"])
            sizes.append((len(now["decode"]), len(now["prefill"])))
            time.sleep(0.2)
        for t in readers:
            t.join(300)
        assert seen_draining is not None, "decode_fpga.1 was never drained"
        assert {s.get("pair") in new_pairs for s in streams} == {True, False}, (streams, new_pairs)
        on_new = next(s for s in streams if s["pair"] in new_pairs)
        assert seen_draining[1] == 1 and on_new["ended"] > seen_draining[0], (
            "the drain began after the stream on decode_fpga.1 ended: make LONG_TOKENS longer", seen_draining)
        for s in streams:  # every token, the same text on both engines
            assert "error" not in s and s["finish"] == "length" and s["tokens"] == LONG_TOKENS, s
        assert streams[0]["text"] == streams[1]["text"]
        # ---- stopped: out of the gateway's pool, its process gone, its port free -------------------
        stack.process.wait_until(lambda: "decode_fpga.1 at" in log.read_text() and "stopped; drained" in
                                 log.read_text(), 60, "decode_fpga.1 stopped", interval=0.5)
        assert [m["address"] for m in pools(stack.url)["decode"]] == [stack.decode_address]
        children = sorted(name for name, _ in module_children(up_pid))
        assert children == ["services.decode_fpga", "services.gateway", "services.prefill_gpu"], children
        assert port_is_free(stack.pair_port("decode", 1))
        # the bounds: never a third decode engine nor a second prefill engine, though the planner asked
        assert max(s[0] for s in sizes) == 2 and max(s[1] for s in sizes) == 1, sizes
        text = log.read_text()
        assert "decode_fpga.2" not in text and "prefill_gpu.1" not in text
        assert "desired 16, target 2 within [1, 2]" in text  # the decision logged with the planner's numbers
        pids = [pid for _, pid in module_children(up_pid)]
    finally:
        stack.stop()
    assert stack.process.proc.returncode == 0 and not any(alive(p) for p in pids)
