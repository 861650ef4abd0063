"""Logprobs through the real stack in every mode: the engines' numbers equal transformers' log-softmax
(to 1e-3) and each other, streamed or not, in the completions and chat shapes; decode_fpga computes
plain greedy rows' logprobs on its device (its metrics say where), prefill_gpu from the rows in torch."""
from __future__ import annotations

import json
import urllib.request

import httpx
import numpy as np
import pytest
import torch

from services.model.tokenizer import chat_prompt_ids
from services.modes import MODE_NAMES
from tests.conftest import hf_greedy, random_prompt
from tests.gateway.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
TOL = 1e-3


def post(stack, path, body):
    r = httpx.post(stack["url"] + path, headers=AUTH, json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def stream(stack, path, body) -> list[dict]:
    events = []
    with httpx.stream("POST", stack["url"] + path, headers=AUTH, timeout=300,
                      json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def logprob_rows(service) -> dict[str, float]:
    """An engine's hybridserve_engine_logprob_rows_total by where they were computed (device, host)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=5).read().decode()
    out = {"device": 0.0, "host": 0.0}
    for line in text.splitlines():
        for where in out:
            if line.startswith(f'hybridserve_engine_logprob_rows_total{{where="{where}"}} '):
                out[where] = float(line.rsplit(" ", 1)[1])
    return out


def rows_delta(stack, request):
    """request()'s result and the logprob rows each engine computed for it, {engine: {where: rows}}."""
    before = {e: logprob_rows(stack[e]) for e in ("prefill", "decode")}
    result = request()
    after = {e: logprob_rows(stack[e]) for e in ("prefill", "decode")}
    return result, {e: {w: after[e][w] - before[e][w] for w in after[e]} for e in after}


def reference(hf_model, tokens: list[int], n_prompt: int) -> np.ndarray:
    """transformers' log-softmax at the positions that predict tokens[n_prompt:]: [n_new, vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[n_prompt - 1:len(tokens) - 1].numpy()


def test_completion_logprobs_equal_transformers_and_each_other_in_every_mode(stack, hf_model, tokenizer):
    n = 4
    new = hf_greedy(hf_model, PROMPT, n)
    ref = reference(hf_model, PROMPT + new, len(PROMPT))
    ref_top = np.argsort(-ref, axis=-1, kind="stable")[:, :5]
    got, tops = {}, {}
    # where each engine computes the n positions' logprobs: decode_fpga on its device, prefill_gpu in torch
    # (hybrid: the first token from prefill_gpu across the hand-off, the rest from decode_fpga)
    where = {"gpu": {"prefill": {"device": 0, "host": n}, "decode": {"device": 0, "host": 0}},
             "fpga": {"prefill": {"device": 0, "host": 0}, "decode": {"device": n, "host": 0}},
             "hybrid": {"prefill": {"device": 0, "host": 1}, "decode": {"device": n - 1, "host": 0}}}
    for mode in MODE_NAMES:
        body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "logprobs": 5, "ignore_eos": True, "mode": mode}
        r, rows = rows_delta(stack, lambda: post(stack, "/v1/completions", body))
        assert rows == where[mode], mode
        lp = r["choices"][0]["logprobs"]
        assert lp["tokens"] == [tokenizer.decode([t]) for t in new], mode
        assert np.allclose(lp["token_logprobs"], ref[np.arange(n), new], atol=TOL, rtol=0), mode
        for i, top in enumerate(lp["top_logprobs"]):
            want = {tokenizer.decode([int(t)]): float(ref[i, t]) for t in ref_top[i]}
            assert set(top) == set(want) and all(abs(top[k] - want[k]) < TOL for k in want), (mode, i)
        assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]])), mode
        got[mode], tops[mode] = lp["token_logprobs"], [list(top) for top in lp["top_logprobs"]]
    assert np.allclose(got["gpu"], got["fpga"], atol=TOL) and np.allclose(got["gpu"], got["hybrid"], atol=TOL)
    assert tops["gpu"] == tops["fpga"] == tops["hybrid"]  # the same tokens in the same order


def test_streamed_chat_logprobs_equal_transformers_in_every_mode(stack, hf_model, tokenizer):
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = chat_prompt_ids(tokenizer, messages)
    n = 3
    new = hf_greedy(hf_model, prompt, n)
    ref = reference(hf_model, prompt + new, len(prompt))
    body = {"messages": messages, "max_tokens": n, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "ignore_eos": True}
    for mode in MODE_NAMES:
        events = stream(stack, "/v1/chat/completions", {**body, "mode": mode})
        content = [c for e in events for ch in e["choices"] if ch.get("logprobs") for c in ch["logprobs"]["content"]]
        assert [c["token"] for c in content] == [tokenizer.decode([t]) for t in new], mode
        assert np.allclose([c["logprob"] for c in content], ref[np.arange(n), new], atol=TOL, rtol=0), mode
        for i, c in enumerate(content):
            assert bytes(c["bytes"]).decode("utf-8", "replace") == c["token"]
            assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"]  # greedy: the best
            assert abs(c["top_logprobs"][1]["logprob"] - np.sort(ref[i])[-2]) < TOL
    unary = post(stack, "/v1/chat/completions", {**body, "mode": "hybrid"})["choices"][0]
    assert [c["token"] for c in unary["logprobs"]["content"]] == [tokenizer.decode([t]) for t in new]
    assert unary["logprobs"]["content"][0]["top_logprobs"][0]["token"] == unary["logprobs"]["content"][0]["token"]


def test_echo_gives_the_prompt_and_its_logprobs_in_every_mode_cached_or_not(stack, hf_model, tokenizer):
    # what lm-evaluation-harness's local-completions sends to score a text: a batch of one token-id prompt,
    # echo, logprobs, no new tokens; 40 tokens: two full blocks, which the second mode finds cached
    prompt = random_prompt(40, tokenizer.vocab_size, seed=5)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1).numpy()
    want = ref[np.arange(len(prompt) - 1), prompt[1:]]
    for mode in MODE_NAMES:
        r, rows = rows_delta(stack, lambda: post(stack, "/v1/completions", {
            "prompt": [prompt], "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0, "mode": mode}))
        if mode == "fpga":  # the prompt's positions 1.. and the one (unshown) token, on decode_fpga's device
            assert rows["decode"] == {"device": len(prompt), "host": 0}, rows
        choice = r["choices"][0]
        assert choice["text"] == tokenizer.decode(prompt) and r["usage"]["completion_tokens"] == 0, mode
        lp = choice["logprobs"]
        assert lp["tokens"] == [tokenizer.decode([t]) for t in prompt], mode
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert np.allclose(lp["token_logprobs"][1:], want, atol=TOL, rtol=0), mode
    # streamed, with new tokens after the prompt: the prompt's text and logprobs come first
    events = stream(stack, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 2, "logprobs": 0,
                                               "temperature": 0, "ignore_eos": True, "mode": "hybrid"})
    pieces = [ch for e in events for ch in e["choices"]]
    assert pieces[0]["text"].startswith(tokenizer.decode(prompt))
    token_logprobs = [v for ch in pieces if ch.get("logprobs") for v in ch["logprobs"]["token_logprobs"]]
    assert len(token_logprobs) == len(prompt) + 2 and token_logprobs[0] is None
    assert np.allclose(token_logprobs[1:len(prompt)], want, atol=TOL, rtol=0)
