"""Several prompts in one completions request (what lm-evaluation-harness's local-completions sends with
batch_size > 1), through the real stack in every mode: choices prompt-major (prompt i's choice j at
i * n + j), each prompt's text the one it gets alone, streamed and not, usage summed; bad elements are a
400 naming `prompt`."""
from __future__ import annotations

import json

import httpx
import pytest

from services.modes import MODE_NAMES
from tests.gateway.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [[504, 3575, 282, 4649, 314], [1780, 314, 253, 1345]]  # "The capital of France is", another
SAMPLED = {"temperature": 1.0, "seed": 11, "max_tokens": 4, "ignore_eos": True}


def post(stack, body) -> httpx.Response:
    return httpx.post(stack["url"] + "/v1/completions", headers=AUTH, json={"model": MODEL, **body}, timeout=300)


def ok(stack, body) -> dict:
    r = post(stack, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_several_prompts_give_each_prompts_own_choices_prompt_major_in_every_mode(stack):
    alone = [[c["text"] for c in ok(stack, {"prompt": p, "n": 2, **SAMPLED, "mode": "gpu"})["choices"]]
             for p in PROMPTS]
    for mode in MODE_NAMES:
        r = post(stack, {"prompt": PROMPTS, "n": 2, **SAMPLED, "mode": mode})
        assert r.status_code == 200, r.text
        assert r.headers["x-hybridserve-mode"].split(",")[0] == mode  # a prompt still waiting: ""
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3], mode
        assert [c["text"] for c in body["choices"]] == alone[0] + alone[1], mode
        assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 16, "total_tokens": 25}, mode
        assert [p["mode"] for p in body["hybridserve"]["prompts"]] == [mode, mode]


def test_several_prompts_streamed_carry_their_index_and_summed_usage(stack):
    texts = ["The capital of France is", "Once upon a time"]
    whole = ok(stack, {"prompt": texts, **SAMPLED, "mode": "hybrid"})
    unary = [c["text"] for c in whole["choices"]]
    streamed, finishes, usage = ["", ""], [], None
    with httpx.stream("POST", stack["url"] + "/v1/completions", headers=AUTH, timeout=300,
                      json={"model": MODEL, "prompt": texts, **SAMPLED, "mode": "hybrid", "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for ch in event["choices"]:
                streamed[ch["index"]] += ch["text"]
                if ch["finish_reason"]:
                    finishes.append(ch["index"])
    assert streamed == unary and sorted(finishes) == [0, 1]
    assert usage == whole["usage"] and usage["completion_tokens"] == 8


def test_several_prompts_scored_with_echo_as_lm_eval_asks(stack):
    # echo + logprobs + max_tokens 0: each prompt's logprobs as when it comes alone
    body = {"echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0, "mode": "fpga"}
    alone = [ok(stack, {"prompt": p, **body})["choices"][0]["logprobs"]["token_logprobs"] for p in PROMPTS]
    together = ok(stack, {"prompt": PROMPTS, **body})
    got = [c["logprobs"]["token_logprobs"] for c in together["choices"]]
    assert [len(g) for g in got] == [5, 4] and got[0][0] is None and got[1][0] is None
    assert all(abs(a - b) < 1e-5 for g, w in zip(got, alone) for a, b in zip(g[1:], w[1:]))
    assert together["usage"]["completion_tokens"] == 0 and together["usage"]["prompt_tokens"] == 9


@pytest.mark.parametrize("prompt", [[[1, 2], []], ["a", ""], ["a", [1, 2]], [[1, 2], 3], [], [[1, 2], [49152]]],
                         ids=["empty ids", "empty text", "text and ids", "ids and an id", "empty", "past vocab"])
def test_a_bad_prompt_element_is_a_400_naming_prompt(stack, prompt):
    r = post(stack, {"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt", r.json()


def test_one_prompt_too_long_refuses_the_request_before_any_engine_call(stack):
    r = post(stack, {"prompt": [[7, 8], [9] * 9000], "max_tokens": 1})  # past every window (8192)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
