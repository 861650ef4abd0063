"""n and best_of through the real stack: several choices per request, each its own seeded random stream,
the same in every mode, streamed with each chunk's index, usage summed; best_of returns the choices of
highest cumulative logprob."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest

from services.modes import MODE_NAMES, MODES
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc
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


def test_a_choice_run_alone_with_its_first_choice_draws_that_choices_random_stream_in_every_mode(stack, tokenizer):
    # what a migrated choice's continuation asks of an engine (services/gateway/dispatch/engine_stream.py): n = 1 and
    # first_choice = j; in hybrid mode the first token is prefill_gpu's, the rest decode_fpga's
    want = post(stack, "/v1/completions", {"prompt": PROMPT, "n": 2, **SAMPLED, "mode": "gpu"})["choices"][1]["text"]
    sampling = pb.SamplingParams(max_tokens=SAMPLED["max_tokens"], temperature=1.0, seed=SAMPLED["seed"],
                                 ignore_eos=True, first_choice=1)
    for mode in MODE_NAMES:
        served_by = stack["prefill" if MODES[mode].served_by == "gpu" else "decode"]
        with grpc.insecure_channel(served_by.address) as ch:
            replies = pb_grpc.EngineStub(ch).Generate(pb.GenerateRequest(
                request_id=f"first-choice-{mode}", prompt_token_ids=PROMPT, sampling=sampling,
                mode=MODES[mode].proto), timeout=300)
            tokens = [t for r in replies for t in r.token_ids]
        assert tokenizer.decode(tokens) == want, mode
