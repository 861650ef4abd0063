"""Streaming OpenAI-completions clients: one request timed token by token, and closed-loop clients.

Times are wall-clock at the client: TTFT to the first chunk that carries text, ITL as the gaps between
such chunks (a chunk that carries several tokens counts once), end-to-end to the stream's end. The
token count is the server's `usage.completion_tokens` when it sends one, else the text chunks.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Target:
    """One server under test: where it is and what it adds to every request body (our `mode`)."""

    name: str
    url: str
    extra: dict = field(default_factory=dict)
    model: str = "default"


def loopback_url(url: str) -> str:
    if urlparse(url).hostname not in LOOPBACK:
        raise SystemExit(f"{url}: only loopback addresses are benchmarked")
    return url.rstrip("/")


def request_body(target: Target, prompt: list[int], n_out: int) -> dict:
    """Greedy, exactly n_out tokens (ignore_eos: both our gateway and llama-server honour it), streamed
    with the usage chunk at the end."""
    return {"model": target.model, "prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **target.extra}


async def one_request(client: httpx.AsyncClient, target: Target, prompt: list[int], n_out: int,
                      on_first: Callable[[], None] | None = None) -> dict:
    """A streamed completion: wall-clock TTFT, gaps between text chunks, e2e, tokens, or the error."""
    t0 = time.perf_counter()
    first = last = None
    gaps, chunks, usage, text = [], 0, None, []
    try:
        async with client.stream("POST", target.url + "/v1/completions", json=request_body(target, prompt, n_out)) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return {"error": f"in stream: {json.dumps(chunk['error'])[:200]}"}
                usage = chunk.get("usage") or usage
                # only chunks carrying text time tokens: the closing chunk follows the last token at once
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    text.append(chunk["choices"][0]["text"])
                    chunks += 1
                    if first is None:
                        first = now - t0
                        if on_first:
                            on_first()
                    else:
                        gaps.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    tokens = (usage or {}).get("completion_tokens") or chunks
    if first is None:
        return {"error": "the stream carried no text"}
    return {"error": None, "ttft": first, "itl": gaps, "e2e": time.perf_counter() - t0, "tokens": tokens,
            "short": tokens < n_out, "last_token": last - t0, "text": "".join(text), "usage": usage or {}}


def async_client(connections: int) -> httpx.AsyncClient:
    """A connection per request, no keep-alive: llama-server closes connections idle for 5 s, and a
    pooled one it has just closed fails the next request with no response (a client artefact, not a
    server error). A loopback connect costs ~0.1 ms, the same for every target."""
    limits = httpx.Limits(max_connections=connections + 2, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10), limits=limits, trust_env=False)


async def closed_loop(target: Target, reqs: list, concurrency: int,
                      prepare: Callable[[list[int]], list[int]] = lambda p: p) -> tuple[list[dict], float]:
    """`concurrency` clients draining `reqs` in order, each sending its next request when one ends;
    `prepare` turns each prompt into the one sent (the Salter)."""
    queue = list(reversed(reqs))
    results: list[dict] = []
    async with async_client(concurrency) as client:
        async def worker() -> None:
            while queue:
                prompt, n_out = queue.pop()
                results.append(await one_request(client, target, prepare(prompt), n_out))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def served_model(url: str) -> str:
    try:
        return httpx.get(url + "/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return "default"


def warm_up(target: Target, prompt: list[int], timeout: float = 300, progress=print) -> None:
    """One small request, retried while the server is still coming up (HTTP 503 or refused)."""
    deadline = time.monotonic() + timeout
    while True:
        r = asyncio.run(closed_loop(target, [(prompt, 4)], 1))[0][0]
        if r["error"] is None:
            return
        if time.monotonic() > deadline or not ("503" in r["error"] or "Connect" in r["error"]):
            raise SystemExit(f"{target.name}: warm-up failed: {r['error']}")
        progress(f"{target.name}: {r['error']}; retrying")
        time.sleep(2)
