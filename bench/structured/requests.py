"""The evaluation's requests: the prompts (prompts.jsonl beside this file), the three variants of each
(free text, greedy with the format, seeded sampled with the format) as OpenAI chat bodies, and a
streamed client that times them and keeps the reply's text, finish_reason and token counts.

Every target gets byte-identical bodies but for the target's own extras (our `mode`). Each request
carries an explicit system message: the default model's chat template adds its own system prompt when
there is none, and with one given our gateway and llama-server (jinja templates, its default) lay out
the same prompt tokens (the JSON records `prompt_tokens` per request, so a difference would show).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.serving.client import Target, async_client

PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
SYSTEM = "You are a helpful assistant. Answer with JSON."
VARIANTS = ("free", "greedy", "sampled")
# seeded sampling, the same for every target: llama-server's own defaults (top_k 40, min_p 0.05) would
# otherwise apply there alone, so both are said; our gateway ignores min_p, and 0 turns it off there
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.0}


@dataclass(frozen=True)
class Prompt:
    id: str
    shape: str  # flat, nested, array, numbers, enum, required
    format: str  # json_object or json_schema
    user: str
    schema: dict | None = None


def load_prompts(path: Path = PROMPTS) -> list[Prompt]:
    prompts = [Prompt(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: prompt ids repeat")
    for p in prompts:
        if p.format not in ("json_object", "json_schema") or (p.format == "json_schema") != (p.schema is not None):
            raise ValueError(f"{path}: {p.id}: json_schema needs a schema, json_object takes none")
    return prompts


def response_format(p: Prompt) -> dict:
    if p.format == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": p.id, "strict": True, "schema": p.schema}}


def request_body(p: Prompt, variant: str, max_tokens: int, seed: int, model: str = "default") -> dict:
    """`free`: greedy, no format (what the model says unconstrained); `greedy`: greedy with the format;
    `sampled`: SAMPLED with the format and this seed."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    body = {"model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p.user}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if variant == "sampled":
        body.update(SAMPLED, seed=seed)
    else:
        body["temperature"] = 0
    if variant != "free":
        body["response_format"] = response_format(p)
    return body


async def one_chat(client, url: str, body: dict) -> dict:
    """A streamed chat completion: its text, finish_reason, token counts, TTFT, the gaps between
    chunks carrying text (ITL), or the error."""
    t0 = time.perf_counter()
    first = last = None
    text, gaps, finish, usage = [], [], None, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return {"error": f"in stream: {json.dumps(chunk['error'])[:300]}"}
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        text.append(piece)
                        if first is None:
                            first = now - t0
                        else:
                            gaps.append(now - last)
                        last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:  # a failed request is a row, not a crash
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    usage = usage or {}
    return {"error": None, "text": "".join(text), "finish_reason": finish, "ttft": first, "itl": gaps,
            "e2e": time.perf_counter() - t0, "tokens": usage.get("completion_tokens"),
            "prompt_tokens": usage.get("prompt_tokens")}


async def run_phase(target: Target, prompts: list[Prompt], variant: str, max_tokens: int, seed: int,
                    concurrency: int) -> list[dict]:
    """Every prompt once in this variant, `concurrency` at a time; rows in the prompts' order."""
    rows: list[dict | None] = [None] * len(prompts)
    queue = list(enumerate(prompts))[::-1]
    async with async_client(concurrency) as client:
        async def worker() -> None:
            while queue:
                i, p = queue.pop()
                body = {**request_body(p, variant, max_tokens, seed + i, target.model), **target.extra}
                rows[i] = {"id": p.id, "variant": variant, **await one_chat(client, target.url, body)}

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return rows
