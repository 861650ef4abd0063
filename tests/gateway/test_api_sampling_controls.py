"""Sampling controls through the real stack: penalties, logit_bias, min_tokens and stop_token_ids give
the same greedy tokens in every mode as a reference loop over transformers' logits, and a seeded
sampled request gives the same text in every mode."""
from __future__ import annotations

import httpx
import pytest
import torch

from services.modes import MODE_NAMES
from tests.gateway.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"


def complete(stack, body) -> dict:
    r = httpx.post(stack["url"] + "/v1/completions", headers=AUTH, timeout=300,
                   json={"model": MODEL, "prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def reference(hf_model, prompt, n, freq=0.0, presence=0.0, repetition=1.0, bias=None, min_tokens=0, stops=()):
    """Greedy tokens with OpenAI's penalties and vLLM's repetition penalty, written out over transformers'
    logits (bias, then min_tokens, then repetition, then frequency and presence, as vLLM orders them)."""
    tokens, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([tokens])).logits[0, -1].float().clone()
            for t, b in (bias or {}).items():
                logits[t] += b
            if len(out) < min_tokens:
                logits[list(stops)] = -float("inf")
            seen = sorted(set(tokens))
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / repetition, vals * repetition)
            for t in set(out):
                logits[t] -= out.count(t) * freq + presence
            token = int(logits.argmax())
            out.append(token)
            tokens.append(token)
            if token in stops:
                break
    return out


def test_penalized_greedy_tokens_equal_a_reference_loop_in_every_mode(stack, hf_model, tokenizer):
    n = 8  # every reference step is a full forward (~1 s on a busy 2-core machine)
    plain = reference(hf_model, PROMPT, 2)
    stop = plain[0]  # the unpenalized first token: min_tokens keeps it out of the first two
    bias = {plain[1]: -5.0, 28: 3.0}
    want = reference(hf_model, PROMPT, n, freq=0.7, presence=0.4, repetition=1.3, bias=bias, min_tokens=2,
                     stops=(stop,))
    assert want[0] != stop and want[:2] != plain  # the controls change the answer
    body = {"max_tokens": n, "temperature": 0, "frequency_penalty": 0.7, "presence_penalty": 0.4,
            "repetition_penalty": 1.3, "logit_bias": {str(k): v for k, v in bias.items()}, "min_tokens": 2,
            "stop_token_ids": [stop], "ignore_eos": True}
    for mode in MODE_NAMES:
        r = complete(stack, {**body, "mode": mode})
        choice = r["choices"][0]
        assert choice["text"] == tokenizer.decode(want, skip_special_tokens=True), mode
        assert choice["finish_reason"] == ("stop" if want[-1] == stop else "length"), mode


def test_a_seeded_sampled_request_gives_the_same_text_in_every_mode(stack):
    body = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 1234, "ignore_eos": True}
    texts = {mode: complete(stack, {**body, "mode": mode})["choices"][0]["text"] for mode in MODE_NAMES}
    assert len(set(texts.values())) == 1, texts
    other = complete(stack, {**body, "seed": 99, "mode": "gpu"})["choices"][0]["text"]
    assert other != texts["gpu"]  # the seed matters
