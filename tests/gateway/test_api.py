"""The OpenAI-compatible API on the real stack, through the `openai` client."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from services.modes import MODE_NAMES
from tests.gateway.conftest import API_KEY, MODEL

# every test here talks to the real stack (three processes, model forwards)
pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def complete(client, mode, prompt="The capital of France is", max_tokens=10, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"mode": mode, **kw.pop("extra", {})}, **kw)


def test_completions_identical_across_modes_with_usage_and_decision(client):
    texts = {}
    for mode in MODE_NAMES:
        r = complete(client, mode)
        ext = r.model_extra["hybridserve"]
        assert (ext["mode"], ext["reason"]) == (mode, "forced")
        assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == 5
        assert r.choices[0].finish_reason == "length"
        texts[mode] = r.choices[0].text
    assert texts["gpu"] == texts["fpga"] == texts["hybrid"] and "Paris" in texts["gpu"]


def test_streamed_completions_and_chat_equal_unstreamed(client):
    for mode in MODE_NAMES:
        whole = complete(client, mode, max_tokens=8).choices[0].text
        chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                                temperature=0, stream=True, extra_body={"mode": mode}))
        assert "".join(c.choices[0].text for c in chunks) == whole
        assert chunks[-1].choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = {m: client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                              extra_body={"mode": m}).choices[0].message.content for m in MODE_NAMES}
    assert len(set(chat.values())) == 1 and "Paris" in chat["gpu"]
    stream = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, extra_body={"mode": "hybrid"}))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat["gpu"]
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens > 0


def test_mode_header_and_token_id_prompt(stack):
    r = httpx.post(stack["url"] + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "prompt": [504, 3575, 282, 4649, 314], "max_tokens": 3, "temperature": 0,
                         "mode": "fpga"})
    assert r.status_code == 200 and r.headers["x-hybridserve-mode"] == "fpga"
    assert r.json()["usage"]["prompt_tokens"] == 5


def test_fields_nothing_reads_are_named_in_a_header_streamed_or_not(stack):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0, "mode": "fpga",
            "guided_decoding_backend": "xgrammar", "frobnicate": 1}
    r = httpx.post(stack["url"] + "/v1/completions", headers=AUTH, timeout=60, json=body)
    assert r.status_code == 200 and r.headers["x-hybridserve-ignored-fields"] == "frobnicate,guided_decoding_backend"
    with httpx.stream("POST", stack["url"] + "/v1/completions", headers=AUTH, timeout=60,
                      json={**body, "stream": True}) as r:
        assert r.headers["x-hybridserve-ignored-fields"] == "frobnicate,guided_decoding_backend"
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    # the fields it reads, extensions included, are not in it
    r = httpx.post(stack["url"] + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "mode": "fpga", "ignore_eos": True,
                         "guided_choice": ["a", "b"]})
    assert r.status_code == 200 and "x-hybridserve-ignored-fields" not in r.headers


def test_continue_final_message_continues_the_assistants_text_in_every_mode(client, tokenizer):
    # vLLM's assistant prefill: the last message's turn is left open and the output goes on inside it
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.rstrip().endswith("One, two,")
    want = complete(client, "gpu", prompt=text, max_tokens=6).choices[0].text  # the same prompt as text
    for mode in MODE_NAMES:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"mode": mode, "continue_final_message": True,
                                                       "add_generation_prompt": False})
        assert r.choices[0].message.content == want, mode
    opened = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            extra_body={"mode": "fpga"})  # a new turn after it, as before
    assert opened.usage.prompt_tokens > r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt false"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    with pytest.raises(openai.BadRequestError, match="last message to be an assistant"):
        client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=2,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})


def test_tokenize_counts_what_generation_counts_and_detokenize_gives_the_text_back(stack):
    def post(path, body, headers=AUTH):
        return httpx.post(stack["url"] + path, headers=headers, timeout=60, json=body)

    prompt = "The capital of France is"
    t = post("/tokenize", {"model": MODEL, "prompt": prompt}).json()
    used = post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, "mode": "fpga"}).json()
    assert t["count"] == len(t["tokens"]) == used["usage"]["prompt_tokens"] and t["max_model_len"] > t["count"]
    assert post("/detokenize", {"model": MODEL, "tokens": t["tokens"]}).json() == {"prompt": prompt}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = post("/tokenize", {"messages": messages}).json()
    used = post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1, "mode": "fpga"}).json()
    assert chat["count"] == used["usage"]["prompt_tokens"]
    # what it refuses, as the generation routes refuse it
    for path, body, status, param in (("/tokenize", {"prompt": "a", "messages": messages}, 400, None),
                                      ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
                                      ("/tokenize", {"messages": messages, "continue_final_message": True,
                                                     "add_generation_prompt": False}, 400, None),
                                      ("/detokenize", {"tokens": [1, 10 ** 6]}, 400, "tokens"),
                                      ("/detokenize", {"tokens": [-1]}, 400, "tokens.0")):
        r = post(path, body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text)
    assert post("/tokenize", {"prompt": "a"}, headers={}).status_code == 401


def test_stop_strings_end_the_text(client):
    full = complete(client, "gpu", max_tokens=12).choices[0].text
    stop = full.strip()[2:5]
    r = complete(client, "gpu", max_tokens=12, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert full.startswith(r.choices[0].text)
    # vLLM's include_stop_str_in_output: the same text with the stop string kept, streamed or not
    kept = complete(client, "fpga", max_tokens=12, stop=[stop], extra={"include_stop_str_in_output": True})
    assert kept.choices[0].text == r.choices[0].text + stop and kept.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                                       stop=[stop], stream=True,
                                       extra_body={"mode": "hybrid", "include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in chunks) == kept.choices[0].text


def test_auto_mode_follows_the_calibrated_router(stack, client):
    for prompt_len, n_out in ((4, 24), (600, 4)):
        r = complete(client, "auto", prompt=[300 + i for i in range(prompt_len)], max_tokens=n_out)
        ext = r.model_extra["hybridserve"]
        assert ext["reason"] in ("auto", "explore") and set(ext["estimates"]) == set(MODE_NAMES)
        # what the router weighed for it, as /debug/router keeps it: the estimates it answered, and the
        # crowding term (what a mode's decode would cost requests already decoding: nonzero while an
        # earlier test's request still runs on an engine, and then part of the choice)
        decisions = httpx.get(stack["url"] + "/debug/router", headers=AUTH, timeout=30).json()["recent_decisions"]
        weighed = [d for d in decisions if (d["n_in"], d["n_out"]) == (prompt_len, n_out)][-1]
        assert (weighed["mode"], weighed["reason"]) == (ext["mode"], ext["reason"])
        assert all(abs(weighed["estimates"][m] - ext["estimates"][m]) < 1e-3 for m in MODE_NAMES)
        if ext["reason"] == "auto":  # "explore": a stage no request has measured yet gets one run
            cost = {m: weighed["estimates"][m] + weighed["crowding"][m] for m in MODE_NAMES}
            assert ext["mode"] == min(cost, key=cost.get), weighed
        assert ext["timings"]["prefill_s"] > 0


def test_models_and_health(stack, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(stack["url"] + "/health")
    assert r.status_code == 200 and r.json()["engines"] == {"prefill_gpu": "up", "decode_fpga": "up"}
    assert r.json()["calibrated"] is True  # the fixture waited until auto had estimates for every mode


ERROR_CASES = [
    # (what, request kwargs for httpx, status, error code)
    ("bad temperature", {"json": {"model": MODEL, "prompt": "x", "temperature": 5}}, 400, "invalid_value"),
    ("n above 16", {"json": {"model": MODEL, "prompt": "x", "n": 17}}, 400, "invalid_value"),
    ("five stops", {"json": {"model": MODEL, "prompt": "x", "stop": list("abcde")}}, 400, "invalid_value"),
    ("malformed JSON", {"content": b'{"model": ', "headers": {"Content-Type": "application/json"}}, 400,
     "invalid_json"),
    ("missing prompt", {"json": {"model": MODEL}}, 400, "invalid_value"),
    ("token id past the vocabulary", {"json": {"model": MODEL, "prompt": [49152]}}, 400, "invalid_value"),
    ("over the context window", {"json": {"model": MODEL, "prompt": "x", "max_tokens": 9000}}, 400,
     "context_length_exceeded"),
    ("unknown model", {"json": {"model": "gpt-4", "prompt": "x"}}, 404, "model_not_found"),
    ("body too large", {"json": {"model": MODEL, "prompt": "x" * 300_000}}, 413, "body_too_large"),
]


@pytest.mark.parametrize("what,kwargs,status,code", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors_are_openai_json_with_exact_status(stack, what, kwargs, status, code):
    headers = {**AUTH, **kwargs.pop("headers", {})}
    r = httpx.post(stack["url"] + "/v1/completions", headers=headers, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and set(err) == {"message", "type", "param", "code"}


def test_auth_and_method_errors(stack):
    url = stack["url"] + "/v1/completions"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(url, headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(stack["url"] + "/v1/nothing", headers=AUTH).status_code == 404


def test_deadline_is_504(client):
    with pytest.raises(openai.APIStatusError) as err:
        complete(client, "fpga", max_tokens=200, extra={"timeout": 0.3, "ignore_eos": True})
    assert err.value.status_code == 504 and err.value.body["code"] == "timeout"


def test_deadline_mid_stream_ends_the_stream_with_an_openai_error_event(stack):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "stream": True,
            "mode": "fpga", "ignore_eos": True, "timeout": 3.0}
    with httpx.stream("POST", stack["url"] + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        if r.status_code == 504:  # a machine so busy that no token came within the deadline: a unary error
            r.read()
            assert r.json()["error"]["code"] == "timeout"
            return
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3  # some text, the error, then [DONE] as any stream ends
    assert json.loads(events[-2]) == {"error": {"message": "the request did not finish within its timeout",
                                                "type": "timeout_error", "param": None, "code": "timeout"}}


def test_engine_queue_full_is_429(client):
    def one(i):
        try:
            complete(client, "gpu", prompt=f"Story {i}:", max_tokens=40, extra={"ignore_eos": True})
            return 200
        except openai.APIStatusError as exc:
            return exc.status_code

    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(one, range(4)))
    assert 429 in codes and 200 in codes


def test_disconnect_mid_stream_frees_the_slot(stack):
    prefill = stack["prefill"]
    body = {"model": MODEL, "prompt": [400 + i for i in range(300)], "max_tokens": 300, "temperature": 0,
            "stream": True, "mode": "hybrid", "ignore_eos": True}
    with httpx.stream("POST", stack["url"] + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token arrived: close the connection mid-stream
    time.sleep(2.0)
    assert prefill.metric("hybridserve_kv_arena_slots_in_use") == 0
    # the decode side freed its sequence: all 4 of its slots serve again at once
    with ThreadPoolExecutor(4) as pool:
        assert all(c for c in pool.map(lambda i: httpx.post(
            stack["url"] + "/v1/completions", headers=AUTH, timeout=120,
            json={"model": MODEL, "prompt": [7, 8, 9 + i], "max_tokens": 2, "mode": "fpga"}).status_code == 200,
            range(4)))
