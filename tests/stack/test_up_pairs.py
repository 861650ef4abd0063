"""`hybridserve up --pairs 2`: two real engine pairs behind one gateway, under a load of 16
streaming clients, and one pair's decode_fpga SIGKILLed while every request is mid-stream.

Checked: both pairs serve (the gateway's per-pair counter and each response's pair); once the
decode engine is gone, every request still ends with all its tokens, the same greedy text as
every other (nothing lost, nothing twice), the lost pair's requests having moved to the other
pair; a wave sent after the kill is carried by the other pair; the supervisor starts the dead
engine again and the gateway takes the pair back. The gateway's KV index (`/debug/kv_index`) held the
killed engine's cached blocks before, forgets them once the engine is found down, and follows the
new engine's epoch after. Then `up` is SIGKILLed: its five children stop on
their own (services/lifetime.py), free every port and remove both KV arenas from /dev/shm (SIGTERM
to `up`, the orderly way, is tested in test_up_heals.py).
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.request

import pytest

from harness.process import listening
from harness.stack import start_stack
from services.decode_fpga.settings import DecodeSettings
from services.kv.arena import SHM_DIR
from services.prefill_gpu.settings import PrefillSettings
from services.launcher.stack import UpSettings
from tests.stack.test_up_heals import alive, http_json, module_children, wait_for

CLIENTS = 16
MAX_TOKENS = 32  # small: two cores carry four engines here
PROMPT = "The capital of France is"


class Client(threading.Thread):
    """One streaming completion: its pair (header), text, finish, usage and migrations."""

    def __init__(self, url: str, model: str, mode: str, first_token: threading.Semaphore):
        super().__init__(daemon=True)
        self.url, self.model, self.mode, self.first_token = url, model, mode, first_token
        self.pair, self.text, self.finish, self.tokens, self.migrations, self.error = None, "", None, None, [], None

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # reported by the test, with the others
            self.error = repr(exc)
        finally:
            if not self.text:
                self.first_token.release()

    def _run(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": self.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "mode": self.mode, "stream": True, "stream_options": {"include_usage": True}}),
            {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            self.error = f"status {r.status}: {r.read()[:200]!r}"
            return
        self.pair = int(r.getheader("x-hybridserve-pair"))
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                self.error = event["error"]["message"]
                continue
            if event.get("usage"):
                self.tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                if choice.get("text") and not self.text:
                    self.first_token.release()
                self.text += choice.get("text") or ""
                if choice.get("finish_reason"):
                    self.finish = choice["finish_reason"]
                    self.migrations = (event.get("hybridserve") or {}).get("migrations") or []
        conn.close()


def pair_calls(url: str) -> dict[int, float]:
    """pair → engine calls opened there, from the gateway's /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    counts: dict[int, float] = {}
    for pair, value in re.findall(r'^hybridserve_pair_calls_total\{[^}]*pair="(\d+)"[^}]*\} (\S+)$', text, re.M):
        counts[int(pair)] = counts.get(int(pair), 0.0) + float(value)
    return counts


def load(url: str, model: str, n: int, modes=("hybrid", "fpga")) -> tuple[list[Client], threading.Semaphore]:
    first = threading.Semaphore(0)
    clients = [Client(url, model, modes[i % len(modes)], first) for i in range(n)]
    for c in clients:
        c.start()
    return clients, first


@pytest.mark.slow
def test_two_pairs_share_the_load_and_a_lost_decode_engine_loses_no_request(tmp_path, profile_cache):
    # the live stacks' shared profile cache: where an earlier stack's sweeps were quiet enough to be
    # cached, these four engines only probe them instead of sweeping in turn
    env = {"HYBRIDSERVE_PROFILE_AT_START": "false", "HYBRIDSERVE_PROFILE_CACHE": str(profile_cache),
           UpSettings.env_name("restart_backoff_s"): "0.5",
           PrefillSettings.env_name("arena_bytes"): str(32 << 20),
           PrefillSettings.env_name("kv_cache_mb"): "128", DecodeSettings.env_name("kv_cache_mb"): "128",
           DecodeSettings.env_name("max_context"): "512", DecodeSettings.env_name("max_sequences"): "2",
           # the first wave's rest and the second wave all on pair 0's decode engine at once
           DecodeSettings.env_name("queue_depth"): str(2 * CLIENTS),
           # the prefix check runs one pair busier than the other: no guard (tests/gateway/test_prefix_routing.py has it)
           "HYBRIDSERVE_GATEWAY_PREFIX_BALANCE_GUARD": "100"}
    stack = start_stack(tmp_path / "up.log", env, timeout=600, pairs=2)
    log = tmp_path / "up.log"
    up_pid = stack.process.proc.pid
    try:
        wait_for(lambda: "hybridserve is up" in log.read_text(), "`up` saying the stack is up", 60)
        status, _, health = http_json(stack.url + "/health")
        assert status == 200 and health["status"] == "ok" and set(health["engines"]) == {"prefill_gpu@0", "decode_fpga@0",
                                                          "prefill_gpu@1", "decode_fpga@1"}
        model = http_json(stack.url + "/v1/models")[2]["data"][0]["id"]
        decode_1 = _decode_pid(stack, up_pid, 1)
        _a_second_turn_goes_where_its_prefix_is(stack.url, model)

        clients, _ = load(stack.url, model, CLIENTS)
        # the kill once pair 1 streams: some of its requests mid-stream, others maybe not started yet
        deadline = time.monotonic() + 300
        while sum(c.pair == 1 and bool(c.text) and c.finish is None for c in clients) < 2:
            assert time.monotonic() < deadline and any(c.is_alive() for c in clients), "pair 1 never streamed"
            time.sleep(0.02)
        on_pair_1 = [c for c in clients if c.pair == 1 and c.finish is None]
        # the gateway's KV index holds the blocks decode_fpga.1 cached (the prefix check's turns and hogs,
        # this load's prompts): at its next Info at the latest, which a loaded machine can delay (a fresh
        # clone's CI once read 0 blocks, cursor 0, at the moment pair 1 streamed)
        deadline = time.monotonic() + 10
        while (known := _kv_index(stack.url, 1))["blocks"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert known["up"] and known["blocks"] > 0 and known["epoch"], known
        os.kill(decode_1, signal.SIGKILL)
        # ... and forgets them once it finds the engine down, while the load still runs
        wait_for(lambda: (lambda k: not k["up"] and k["blocks"] == 0 and not k["epoch"])(_kv_index(stack.url, 1)),
                 "the KV index forgetting decode_fpga.1's blocks", 60)
        # pair 1 has no decode engine now: the other pair carries a new wave in the modes that need one. Sent
        # at once, not after the first wave: the supervisor's restart (0.5 s, then the engine's start) had
        # pair 1 back before a first wave's end on a fast start, and half that wave went there
        after, _ = load(stack.url, model, CLIENTS // 2)
        for c in clients + after:
            c.join(300)

        assert [c.error for c in clients + after] == [None] * (CLIENTS + CLIENTS // 2)
        served = pair_calls(stack.url)  # a call counts once its first token is in
        assert {c.pair for c in clients} == {0, 1} and served.get(0) and served.get(1)
        assert all(c.finish == "length" and c.tokens == MAX_TOKENS for c in clients + after)
        assert len({c.text for c in clients + after}) == 1  # greedy: the same text, migrated or not
        moved = [c for c in clients if c.migrations]
        assert on_pair_1, "no request was in flight on pair 1 when its decode engine died"
        # to the other pair (the same mode there unless its health check lagged under this load)
        assert moved and all(mg["from_pair"] == 1 and mg["to_pair"] == 0 for c in moved for mg in c.migrations)
        assert [c.pair for c in after] == [0] * (CLIENTS // 2) and not any(c.migrations for c in after)

        # the supervisor starts decode_fpga.1 again; the gateway puts pair 1 back
        wait_for(lambda: (_decode_pid(stack, up_pid, 1) or decode_1) != decode_1, "a new decode_fpga.1", 120)
        wait_for(lambda: http_json(stack.url + "/health")[2].get("status") == "ok", "pair 1 back in", 600)
        # the new engine's events start a new epoch: nothing of the dead one's cache comes back
        wait_for(lambda: _kv_index(stack.url, 1)["epoch"] not in ("", known["epoch"]), "decode_fpga.1's new epoch", 30)
        assert "decode_fpga.1 exited (killed by SIGKILL)" in log.read_text()
    finally:
        pids = _children(up_pid)
        arenas = re.findall(r"\[prefill_gpu\.\d\] .*KV arena (\S+): \d+ MiB", log.read_text())
        os.kill(up_pid, signal.SIGKILL)  # as a time limit or the OOM killer would: no chance to stop its children
        stack.process.stop()
        try:
            wait_for(lambda: not any(alive(p) for p in pids), "`up`'s children gone after `up` was SIGKILLed", 60)
        finally:
            for p in pids:
                if alive(p):
                    os.kill(p, signal.SIGKILL)
    assert len(pids) == 5 and len(arenas) == 2  # two pairs and the gateway; each prefill_gpu's arena
    assert not any((SHM_DIR / name).exists() for name in arenas)
    ports = [stack.pair_port(name, pair) for pair in (0, 1)
             for name in ("prefill", "prefill_metrics", "decode", "decode_metrics")]
    # the processes are gone; their listening sockets close with them (a fresh clone's CI saw two metrics
    # ports still accept for a moment after): bounded, nothing may stay listening
    wait_for(lambda: not [port for port in [*ports, stack.ports["gateway"]] if listening(port)],
             "nothing listening on the stack's ports", 30)


TURN = ("Once upon a time there was a small robot who lived in a lighthouse by the sea. Every night it "
        "climbed the stairs, polished the great lamp and counted the ships that passed, writing each name in")


class Hog(threading.Thread):
    """A long streamed completion that keeps one pair busy until stop() drops its connection."""

    def __init__(self, url: str, model: str, prompt: str):
        super().__init__(daemon=True)
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=300)
        self.body = {"model": model, "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                     "mode": "fpga", "stream": True}
        self.pair, self.streaming, self.done = None, threading.Event(), threading.Event()

    def run(self) -> None:
        try:
            self.conn.request("POST", "/v1/completions", json.dumps(self.body), {"Content-Type": "application/json"})
            r = self.conn.getresponse()
            self.pair = int(r.getheader("x-hybridserve-pair"))
            for raw in r:
                if raw.startswith(b"data: {"):
                    self.streaming.set()
                if self.done.is_set():
                    return
        except (OSError, http.client.HTTPException):
            pass  # the connection dropped by stop()
        finally:
            self.streaming.set()

    def stop(self) -> None:
        """Drop the connection (the gateway cancels the request) and wait for the reader to end."""
        self.done.set()
        if self.conn.sock is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)  # the reader's next read ends; closing is its own
        self.join(60)
        self.conn.close()


def _a_second_turn_goes_where_its_prefix_is(url: str, model: str) -> None:
    """Prefix-aware placement, live: the first turn lands on pair X while the other pair is busy;
    then, with X the busier pair (a long request sharing the prefix runs there), the second turn
    still goes to X for its cached prefix, where the least-loaded choice alone would take the other."""
    def complete(prompt: str) -> dict:
        status, _, body = http_json(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2,
                                                             "temperature": 0, "mode": "fpga"})
        assert status == 200, body
        return body["hybridserve"]["placement"]

    # both pairs' loads as the engines report them now: a report taken while the gateway's own
    # calibration calls ran can count them for up to a health interval after (a fresh clone's CI
    # then placed the turn beside the hog)
    time.sleep(2.5)
    hog = Hog(url, model, "The capital of France is")
    hog.start()
    assert hog.streaming.wait(300) and hog.pair in (0, 1)
    first = complete(TURN)
    x = 1 - hog.pair
    assert first == {"pair": x, "reason": "load", "prefix_hit_tokens": 0}, first
    hog.stop()
    time.sleep(2.5)  # the gateway learns the new blocks (and the idle loads) at its next Info, every second
    busy = Hog(url, model, TURN + " a lighthouse keeper's log.")
    busy.start()
    try:
        assert busy.streaming.wait(300) and busy.pair == x
        time.sleep(1.5)
        second = complete(TURN + " a little book.")
        assert second["pair"] == x and second["reason"] == "prefix" and second["prefix_hit_tokens"] >= 32, second
    finally:
        busy.stop()
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    assert re.search(r'^hybridserve_pair_placements_total\{reason="prefix"\} [1-9]', text, re.M)


def _kv_index(url: str, pair: int) -> dict:
    """The gateway's picture of pair `pair`'s decode_fpga cache (GET /debug/kv_index)."""
    status, _, body = http_json(url + "/debug/kv_index")
    assert status == 200, body
    return body["pairs"][str(pair)]["decode_fpga"]


def _decode_pid(stack, up_pid: int, pair: int) -> int | None:
    """The pid of pair `pair`'s decode_fpga: the child of `up` listening on that pair's decode port."""
    port = stack.pair_port("decode", pair)
    for pid in _children(up_pid, "services.decode_fpga"):
        if f"{DecodeSettings.env_name('port')}={port}".encode() in open(f"/proc/{pid}/environ", "rb").read():
            return pid
    return None


def _children(up_pid: int, module: str = "services.") -> list[int]:
    """The pids of `up`'s `python -m <module...>` children."""
    return [pid for name, pid in module_children(up_pid) if name.startswith(module)]
