"""`hybridserve up --prefill 1 --decode 1 --autoscale --max-prefill 2 --max-decode 2`: pools grown to
2P:2D by the planner, every prefill engine feeding every decode engine, then shrunk back.

Checked with real processes on loopback, in one stack (an engine start costs tens of seconds here):
* grow: the planner's targets are so tight (a microsecond) that any load makes it want its most replicas;
  under load `up` starts prefill_gpu.1 and decode_fpga.1 (one each: the bounds are 2), each joining the
  gateway's pools once it answers, and nothing more;
* pools: the gateway sees the four (prefill, decode) combinations as pairs; hybrid requests spread over
  both prefill and both decode engines, each decode engine pulling its KV from the prefill engine the
  gateway named (also the one that is not its own: each prefill engine ran exactly the hand-offs of the
  pairs naming it), and give gpu mode's greedy tokens;
* shrink: with the load gone (the planner's window is 2 s) `up` drains the engines it started while a
  long stream runs on decode_fpga.1; the stream runs to its last token (the same text as on
  decode_fpga.0), and only then are the engines removed and stopped, their ports free;
* nothing is left running.
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request

import pytest

from harness.stack import start_stack
from services.decode_fpga.settings import DecodeSettings
from services.gateway.settings import GatewaySettings
from services.prefill_gpu.settings import PrefillSettings
from services.launcher.stack import UpSettings
from tests.stack.test_up_heals import alive, http_json, module_children

PROMPT = "The capital of France is"
REQUESTS = 8
LONG_TOKENS = 800  # a stream that outlives the planner's window and the hold down several times over


def prefill_requests(stack, i: int) -> float:
    """Prefills prefill engine i computed (its Prefill calls for hybrid mode, and gpu mode's), counted
    before the first token goes out (a finished-request count may miss a call the reader ends at once)."""
    url = f"http://127.0.0.1:{stack.pair_port('prefill_metrics', i)}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.search(r'^hybridserve_stage_seconds_count\{device="gpu",stage="prefill"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def listening(port: int) -> bool:
    """Whether a process listens on the port (a stopped server's port can be bound again at once by a
    server, which sets SO_REUSEADDR, though its closed connections keep it in TIME_WAIT for a while)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def pools(url: str) -> dict[str, list[dict]]:
    return http_json(url + "/debug/planner")[2]["pools"]


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


@pytest.mark.slow
def test_pools_grow_to_two_by_two_serve_every_combination_then_drain_back(tmp_path, profile_cache):
    env = {"HYBRIDSERVE_PROFILE_AT_START": "false", "HYBRIDSERVE_PROFILE_CACHE": str(profile_cache),
           UpSettings.env_name("prefill_engines"): "1", UpSettings.env_name("decode_engines"): "1",
           UpSettings.env_name("autoscale"): "true", UpSettings.env_name("max_prefill_engines"): "2",
           UpSettings.env_name("max_decode_engines"): "2", UpSettings.env_name("autoscale_interval_s"): "0.25",
           UpSettings.env_name("scale_up_hold_s"): "0.5", UpSettings.env_name("scale_cooldown_s"): "1",
           # the hold down outlasts a slow request of the load: an engine being started is not stopped
           UpSettings.env_name("scale_down_hold_s"): "2",
           GatewaySettings.env_name("planner_ttft_s"): "1e-6", GatewaySettings.env_name("planner_itl_s"): "1e-6",
           GatewaySettings.env_name("planner_window_s"): "2",
           PrefillSettings.env_name("arena_bytes"): str(32 << 20),
           PrefillSettings.env_name("kv_cache_mb"): "96", DecodeSettings.env_name("kv_cache_mb"): "96",
           DecodeSettings.env_name("max_context"): "1024"}
    log = tmp_path / "up.log"
    stack = start_stack(log, env, timeout=600, engines_per_kind=2)
    up_pid = stack.process.proc.pid
    scaled = {"prefill": f"127.0.0.1:{stack.pair_port('prefill', 1)}",
              "decode": f"127.0.0.1:{stack.pair_port('decode', 1)}"}
    sizes = []  # (prefill engines, decode engines) in the gateway's pools, as seen along the way
    try:
        model = http_json(stack.url + "/v1/models")[2]["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reference = http_json(stack.url + "/v1/completions", {**body, "mode": "gpu"})[2]["choices"][0]["text"]
        # ---- grow: under load the planner wants more of both; `up` starts one engine of each --------
        stop, served = threading.Event(), []

        def load() -> None:
            while not stop.is_set():
                status, _, reply = http_json(stack.url + "/v1/completions", {**body, "max_tokens": 4,
                                                                             "mode": "hybrid"})
                served.append((status, reply.get("choices", [{}])[0].get("text")))
                stop.wait(0.1)  # a steady demand, leaving the cores to the engines being started
        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        try:
            while True:
                now = pools(stack.url)
                sizes.append((len(now["prefill"]), len(now["decode"])))
                if all(any(m["address"] == scaled[p] and m["up"] and not m["draining"] for m in now[p])
                       for p in scaled):
                    break
                assert time.monotonic() < deadline, f"the pools never grew to 2P:2D: {now}"
                time.sleep(0.25)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert served and all(status == 200 and text == reference[:len(text)] for status, text in served), served
        # ---- 2P:2D: every combination a pair, each request on the prefill engine it names -----------
        now = pools(stack.url)
        prefill_of = {p: i for i, m in enumerate(now["prefill"]) for p in m["pairs"]}
        decode_of = {p: j for j, m in enumerate(now["decode"]) for p in m["pairs"]}
        assert [m["address"] for m in now["prefill"]] == [stack.prefill_address, scaled["prefill"]]
        assert [m["address"] for m in now["decode"]] == [stack.decode_address, scaled["decode"]]
        assert len(prefill_of) == 4 and {(prefill_of[p], decode_of[p]) for p in prefill_of} == {
            (0, 0), (0, 1), (1, 0), (1, 1)}
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
        pairs = [r[1] for r in results]
        assert {prefill_of[p] for p in pairs} == {0, 1} and {decode_of[p] for p in pairs} == {0, 1}, pairs
        assert {r[2]["choices"][0]["text"] for r in results} == {reference}
        assert all(r[2]["hybridserve"]["timings"]["handoff_bytes"] > 0 for r in results)
        # each prefill engine prefilled for exactly the requests whose pair named it, (p1, d0) included,
        # where decode_fpga.0 would have asked its own prefill_gpu.0 had the gateway not named one
        after = [prefill_requests(stack, i) for i in (0, 1)]
        assert [a - b for a, b in zip(after, before)] == [sum(prefill_of[p] == i for p in pairs) for i in (0, 1)]
        assert sorted(name for name, _ in module_children(up_pid)) == [
            "services.decode_fpga", "services.decode_fpga", "services.gateway", "services.prefill_gpu",
            "services.prefill_gpu"]
        # ---- shrink: long streams, one on decode_fpga.1; the load is over: `up` drains -------------
        long_body = {**body, "prompt": "Once upon a time", "max_tokens": LONG_TOKENS, "mode": "hybrid"}
        streams, readers = [], []
        while not any(decode_of.get(s.get("pair")) == 1 for s in streams):
            assert len(streams) < 4, streams
            streams.append({})
            readers.append(threading.Thread(target=stream, args=(stack.url, long_body, streams[-1])))
            readers[-1].start()
            while "pair" not in streams[-1] and readers[-1].is_alive():
                time.sleep(0.05)
            time.sleep(1.2)  # the engines' next Info shows this one busy: the next goes elsewhere
        seen_draining = None
        deadline = time.monotonic() + 120
        while seen_draining is None and time.monotonic() < deadline:
            now = pools(stack.url)
            sizes.append((len(now["prefill"]), len(now["decode"])))
            member = next((m for m in now["decode"] if m["address"] == scaled["decode"]), None)
            if member is None or member["draining"]:
                seen_draining = (time.monotonic(), member and member["calls_open"])
            time.sleep(0.2)
        for t in readers:
            t.join(300)
        assert seen_draining is not None, "decode_fpga.1 was never drained"
        on_new = next(s for s in streams if decode_of.get(s.get("pair")) == 1)
        assert seen_draining[1] and on_new["ended"] > seen_draining[0], (
            "the drain began after the stream on decode_fpga.1 ended: make LONG_TOKENS longer", seen_draining)
        for s in streams:  # every token; the same text on both decode engines
            assert "error" not in s and s["finish"] == "length" and s["tokens"] == LONG_TOKENS, s
        assert len({s["text"] for s in streams}) == 1
        # ---- back to 1P:1D: out of the gateway's pools, the processes gone, their ports free --------
        stack.process.wait_until(lambda: log.read_text().count("stopped; drained") == 2, 90,
                                 "both scaled engines stopped", interval=0.5)
        now = pools(stack.url)
        assert [m["address"] for m in now["prefill"]] == [stack.prefill_address]
        assert [m["address"] for m in now["decode"]] == [stack.decode_address]
        assert sorted(name for name, _ in module_children(up_pid)) == [
            "services.decode_fpga", "services.gateway", "services.prefill_gpu"]
        assert not listening(stack.pair_port("decode", 1)) and not listening(stack.pair_port("prefill", 1))
        assert listening(stack.pair_port("decode", 0))  # (the check itself)
        # the bounds: never a third engine of a pool, though the planner asked for 16
        assert max(s[0] for s in sizes) == 2 and max(s[1] for s in sizes) == 2, sizes
        text = log.read_text()
        assert "decode_fpga.2" not in text and "prefill_gpu.2" not in text
        assert "desired 16, target 2 within [1, 2]" in text  # each decision logged with the planner's numbers
        pids = [pid for _, pid in module_children(up_pid)]
    finally:
        stack.stop()
    assert stack.process.proc.returncode == 0 and not any(alive(p) for p in pids)
