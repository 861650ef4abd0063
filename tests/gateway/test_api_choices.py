"""n and best_of through the real stack: several choices per request, each its own seeded random stream,
the same in every mode, streamed with each chunk's index, usage summed; best_of returns the choices of
highest cumulative logprob."""
from __future__ import annotations

import json

import httpx
import pytest

from services.modes import MODE_NAMES
from tests.gateway.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
SAMPLED = {"temperature": 1.0, "seed": 5, "max_tokens": 6, "ignore_eos": True}


def post(stack, path, body) -> dict:
    r = httpx.post(stack["url"] + path, headers=AUTH, json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_n_choices_are_seeded_apart_and_equal_across_modes_with_usage_summed(stack):
    texts = {}
    for mode in MODE_NAMES:
        r = post(stack, "/v1/completions", {"prompt": PROMPT, "n": 3, "logprobs": 0, **SAMPLED, "mode": mode})
        assert [c["index"] for c in r["choices"]] == [0, 1, 2], mode
        assert r["usage"]["completion_tokens"] == 18 and r["usage"]["prompt_tokens"] == 5, mode
        texts[mode] = [c["text"] for c in r["choices"]]
        if mode == "gpu":
            logprob_sums = [sum(c["logprobs"]["token_logprobs"]) for c in r["choices"]]
    assert texts["gpu"] == texts["fpga"] == texts["hybrid"]
    assert len(set(texts["gpu"])) > 1  # each choice its own random stream
    # best_of: the same three, and the one of highest cumulative logprob comes back
    best = post(stack, "/v1/completions", {"prompt": PROMPT, "n": 1, "best_of": 3, **SAMPLED, "mode": "gpu"})
    assert [c["text"] for c in best["choices"]] == [texts["gpu"][logprob_sums.index(max(logprob_sums))]]
    assert best["choices"][0]["logprobs"] is None and best["usage"]["completion_tokens"] == 18
    # echo: every choice gives back the prompt and its logprobs (computed once, by choice 0)
    echoed = post(stack, "/v1/completions", {"prompt": PROMPT, "n": 2, "echo": True, "logprobs": 0, **SAMPLED,
                                             "mode": "hybrid"})["choices"]
    prompt_part = [c["logprobs"]["token_logprobs"][:len(PROMPT)] for c in echoed]
    assert prompt_part[0] == prompt_part[1] and prompt_part[0][0] is None and None not in prompt_part[0][1:]


def test_streamed_chat_choices_carry_their_index(stack):
    body = {"messages": [{"role": "user", "content": "Say something."}], "n": 2, **SAMPLED, "mode": "hybrid"}
    unary = [c["message"]["content"] for c in post(stack, "/v1/chat/completions", body)["choices"]]
    streamed, roles, finishes = ["", ""], set(), set()
    with httpx.stream("POST", stack["url"] + "/v1/chat/completions", headers=AUTH, timeout=300,
                      json={"model": MODEL, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                streamed[ch["index"]] += ch["delta"].get("content") or ""
                if ch["delta"].get("role"):
                    roles.add(ch["index"])
                if ch["finish_reason"]:
                    finishes.add(ch["index"])
    assert streamed == unary and roles == finishes == {0, 1}
