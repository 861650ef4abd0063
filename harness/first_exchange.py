"""A stack's first traffic as a user sends it the moment /health allows: a stream, then a long prompt beside it.

Shared by the readiness test (tests/stack/test_up_ready.py) and the cold-start benchmark
(bench/cold_start.py): poll /health until it answers 200 (noting whether /livez answered meanwhile),
then stream a chat answer and, once it decodes, send a long prompt; the stream's gaps while the long
prompt ran are what a user feels. Requests use urllib only: no client library in between.
"""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


def get_json(url: str) -> tuple[int | None, dict]:
    """(status, body) of a GET; (None, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return None, {}


@dataclass
class Readiness:
    """What polling /health until its first 200 saw."""

    body: dict  # the first 200's
    not_ready: list[dict] = field(default_factory=list)  # the 503 bodies before it
    live_while_not_ready: bool = False  # /livez answered 200 while /health said 503
    seconds: float = 0.0


def wait_ready(url: str, timeout_s: float, alive=lambda: True, interval_s: float = 0.2) -> Readiness:
    """Poll `url`/health until it answers 200; `alive()` False (the stack died) or the timeout: an error."""
    t0, seen, live = time.monotonic(), [], False
    while (health := get_json(url + "/health"))[0] != 200:
        if health[0] == 503:
            seen.append(health[1])
            live = live or get_json(url + "/livez")[0] == 200
        if not alive():
            raise RuntimeError(f"the stack exited before it was ready; last /health {health}")
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"not ready within {timeout_s} s; last /health {health}")
        time.sleep(interval_s)
    return Readiness(health[1], seen, live, time.monotonic() - t0)


def calibration_checks_ran(url: str) -> float:
    """The gateway's hybridserve_calibration_checks_total{outcome="ran"}, summed over modes."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("hybridserve_calibration_checks_total{") and 'outcome="ran"' in line)


@dataclass
class Exchange:
    arrivals: list[float]  # the stream's event times
    long_sent: float
    long_done: float  # the last long prompt's answer
    long_body: dict  # the first long prompt's answer
    long_seconds: list[float] = field(default_factory=list)  # each long prompt's time in the stack
    long_bodies: list[dict] = field(default_factory=list)
    stream_tokens: int | None = None  # the stream's completion tokens, from its usage chunk

    @property
    def gaps_during_long(self) -> list[float]:
        """The stream's gaps that overlap the long prompt's time in the stack."""
        a = self.arrivals
        return [y - x for x, y in zip(a, a[1:]) if y >= self.long_sent and x <= self.long_done]


def _post(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.load(r)


def _stream(url: str, body: dict, arrivals: list[float], usage: dict, timeout_s: float) -> None:
    """The times of the stream's chunks that carry choices (a busy gateway may put several tokens in one); its
    usage chunk's figures into `usage`."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for line in r:
            if line.startswith(b"data: {"):
                at = time.monotonic()
                chunk = json.loads(line[len(b"data: "):])
                if chunk.get("choices"):
                    arrivals.append(at)
                if chunk.get("usage"):
                    usage.update(chunk["usage"])


def first_exchange(url: str, model: str, long_tokens: int, stream_tokens: int, mode: str | None = None,
                   seed: int = 58, timeout_s: float = 600, at_once: int = 1) -> Exchange:
    """The stream (`stream_tokens`, ignore_eos) and, once it has 10 events, `at_once` prompts of `long_tokens`
    random token ids each (8 tokens out), sent together; all in `mode` (None: auto). Returns once all are done."""
    forced = {"mode": mode} if mode else {}
    arrivals: list[float] = []
    usage: dict = {}
    streamer = threading.Thread(target=_stream, args=(url, {
        "model": model, "messages": [{"role": "user", "content": "Tell me a long story about a cat."}],
        "max_tokens": stream_tokens, "temperature": 0, "ignore_eos": True, **forced}, arrivals, usage, timeout_s))
    streamer.start()
    while len(arrivals) < 10 and streamer.is_alive():
        time.sleep(0.01)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 40000) for _ in range(long_tokens)] for _ in range(at_once)]
    bodies: list[dict] = [{} for _ in prompts]
    seconds = [0.0] * len(prompts)

    def send(i: int) -> None:
        t = time.monotonic()
        bodies[i] = _post(url + "/v1/completions", {"model": model, "max_tokens": 8, "temperature": 0, **forced,
                                                    "prompt": prompts[i]}, timeout_s)
        seconds[i] = time.monotonic() - t

    sent = time.monotonic()
    senders = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in senders:
        t.start()
    for t in senders:
        t.join(timeout_s)
    done = time.monotonic()
    streamer.join(timeout_s)
    if not all(bodies):
        raise RuntimeError("a long prompt got no answer")
    return Exchange(arrivals, sent, done, bodies[0], seconds, bodies, usage.get("completion_tokens"))
