"""The HTTP edge of the real gateway (uvicorn on loopback, in this process) with no engine behind it.

Everything here is decided before an engine is called: the body limit and read deadline, the
API key, the documents, request validation, tokenizing off the event loop, the uvicorn limits.
A valid request reaches the dispatcher and gets 503 (no engine is up), which shows it passed.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time

import httpx
import pytest
import uvicorn

from services.gateway.api.app import create_app
from services.gateway.api.server import config
from services.gateway.settings import GatewaySettings
from tests.gateway.conftest import API_KEY
from tests.services_harness import free_port

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "SmolLM2-135M-Instruct"  # the served name of the default checkpoint (no engine tells us otherwise here)
LIMIT = 200_000


@pytest.fixture(scope="module")
def edge():
    settings = GatewaySettings(prefill_address=f"127.0.0.1:{free_port()}", decode_address=f"127.0.0.1:{free_port()}",
                               port=free_port(), api_key=API_KEY, max_body_bytes=LIMIT, body_read_timeout_s=2.0,
                               served_model_name=MODEL, health_interval_s=30, log_level="WARNING")
    server = uvicorn.Server(config(settings))
    thread = threading.Thread(target=server.run, name="gateway-loop", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:  # the lifespan loads the tokenizer first
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the gateway did not start")
        time.sleep(0.1)
    try:
        yield {"url": f"http://127.0.0.1:{settings.port}", "app": server.config.app, "loop_thread": thread}
    finally:
        server.should_exit = True
        thread.join(20)


def post(edge, path, body, headers=AUTH):
    # json.dumps escapes non-ASCII, so a lone surrogate travels as JSON's own \ud800 escape
    return httpx.post(edge["url"] + path, content=json.dumps(body), timeout=30,
                      headers={**headers, "Content-Type": "application/json"})


# ---- the body limit and deadline ----------------------------------------------------------
def test_a_chunked_body_over_the_limit_gets_413_before_it_is_all_sent(edge):
    sent = 0
    total = 30 << 20

    def body():  # no length up front: httpx sends it with Transfer-Encoding: chunked
        nonlocal sent
        chunk = b" " * (64 << 10)
        while sent < total:
            sent += len(chunk)
            yield chunk

    r = httpx.post(edge["url"] + "/v1/completions", content=body(), timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "body_too_large"
    assert sent < total  # the answer came while most of the body was still unsent: the server did not read it all


def test_a_chunked_body_within_the_limit_reaches_the_route(edge):
    def body():
        yield b'{"model": "' + MODEL.encode() + b'", '
        yield b'"prompt": "hi", "max_tokens": 0}'

    r = httpx.post(edge["url"] + "/v1/completions", content=body(), timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_a_body_that_does_not_arrive_in_time_gets_408(edge):
    def body():
        yield b'{"model": '
        time.sleep(4)  # past the 2 s body-read deadline
        yield b'"x", "prompt": "hi"}'

    r = httpx.post(edge["url"] + "/v1/completions", content=body(), timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 408 and r.json()["error"]["code"] == "body_read_timeout", r.text


# ---- the API key, the documents, /metrics -----------------------------------------------
@pytest.mark.parametrize("path", ["/metrics", "/openapi.json", "/docs", "/redoc", "/v1/models"])
def test_with_a_key_every_route_but_health_needs_it(edge, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {API_KEY}x"},
                    {"Authorization": API_KEY}):
        r = httpx.get(edge["url"] + path, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
    assert httpx.get(edge["url"] + path, headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(edge["url"] + "/health", timeout=30).status_code == 503  # open, and no engine is up


def test_the_key_is_compared_in_constant_time(edge, monkeypatch):
    compared = []
    real = hmac.compare_digest

    def recording(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    assert httpx.get(edge["url"] + "/v1/models", headers={"Authorization": "Bearer guess"}).status_code == 401
    assert compared  # the comparison went through hmac.compare_digest, not ==


def test_metrics_open_lets_a_scraper_in_without_the_key():
    async def get(app, path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return await c.get(path)

    open_app = create_app(GatewaySettings(api_key=API_KEY, metrics_open=True))
    assert asyncio.run(get(open_app, "/metrics")).status_code == 200
    assert asyncio.run(get(open_app, "/openapi.json")).status_code == 401  # only /metrics opens
    closed_app = create_app(GatewaySettings(api_key=API_KEY))
    assert asyncio.run(get(closed_app, "/metrics")).status_code == 401


@pytest.mark.parametrize("host,key,warns", [("0.0.0.0", None, True), ("192.168.1.5", None, True),
                                            ("0.0.0.0", API_KEY, False), ("127.0.0.1", None, False),
                                            ("::1", None, False), ("localhost", None, False)])
def test_listening_beyond_loopback_with_no_key_logs_a_warning(caplog, host, key, warns):
    with caplog.at_level(logging.WARNING, logger="services.gateway"):
        create_app(GatewaySettings(host=host, api_key=key))
    warned = any("no API key" in r.getMessage() for r in caplog.records)
    assert warned == warns


# ---- the OpenAPI document -----------------------------------------------------------------
def test_the_document_declares_every_error_in_the_error_shape(edge):
    doc = httpx.get(edge["url"] + "/openapi.json", headers=AUTH, timeout=30).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        for status in ("400", "401", "404", "413", "429", "503", "504"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref == "#/components/schemas/ErrorBody", (path, status)
        assert "422" not in responses and "text/event-stream" in responses["200"]["content"]
    assert "401" in doc["paths"]["/metrics"]["get"]["responses"]


def test_the_document_declares_the_logprobs_and_sampling_controls(edge):
    doc = httpx.get(edge["url"] + "/openapi.json", headers=AUTH, timeout=30).json()
    schemas = doc["components"]["schemas"]
    controls = {"frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                "stop_token_ids", "logprobs"}
    assert controls <= set(schemas["CompletionRequest"]["properties"])
    assert controls | {"top_logprobs"} <= set(schemas["ChatCompletionRequest"]["properties"])
    completion_logprobs = set(schemas["CompletionLogprobs"]["properties"])
    assert {"tokens", "token_logprobs", "top_logprobs", "text_offset"} <= completion_logprobs
    assert {"token", "logprob", "bytes", "top_logprobs"} <= set(schemas["ChatTokenLogprob"]["properties"])


# ---- validation: 400 naming the parameter, never 500, never ignored ------------------------
def completion(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


U32, U64 = 1 << 32, 1 << 64
BAD = [
    # (what, path, body, param, code)
    ("max_tokens past uint32", "/v1/completions", completion(max_tokens=U32), "max_tokens", "invalid_value"),
    ("top_k past uint32", "/v1/completions", completion(top_k=U32), "top_k", "invalid_value"),
    ("seed past uint64", "/v1/completions", completion(seed=U64), "seed", "invalid_value"),
    ("negative seed", "/v1/completions", completion(seed=-1), "seed", "invalid_value"),
    ("negative top_k", "/v1/chat/completions", chat(top_k=-1), "top_k", "invalid_value"),
    ("negative max_tokens", "/v1/chat/completions", chat(max_tokens=-5), "max_tokens", "invalid_value"),
    ("token id past uint32", "/v1/completions", completion(prompt=[1, U32]), "prompt.1", "invalid_value"),
    ("lone surrogate in a prompt", "/v1/completions", completion(prompt="a\ud800b"), "prompt", "invalid_value"),
    ("lone surrogate in a message", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "\udc00"}]), "messages.0.content", "invalid_value"),
    ("lone surrogate in a stop", "/v1/completions", completion(stop=["\ud83d"]), "stop.0", "invalid_value"),
    ("lone surrogate in the model", "/v1/completions", completion(model="m\ud800"), "model", "invalid_value"),
    ("an image part", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages.0.content.0.type", "invalid_value"),
    ("a text part without text", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), "messages.0.content.0.text",
     "invalid_value"),
    ("a part that is not an object", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": ["hi"]}]), "messages.0.content.0", "invalid_value"),
    ("null user content", "/v1/chat/completions", chat(messages=[{"role": "user", "content": None}]),
     "messages.0.content", "invalid_value"),
    ("absent system content", "/v1/chat/completions", chat(messages=[{"role": "system"}, {"role": "user",
                                                                                         "content": "hi"}]),
     "messages.0.content", "invalid_value"),
    ("null assistant content without tool calls", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]),
     "messages.1.content", "invalid_value"),
    ("max_tokens 0 without echo", "/v1/completions", completion(max_tokens=0), "max_tokens", "invalid_value"),
    ("prompts mixing text and ids", "/v1/completions", completion(prompt=["a", [1, 2]]), "prompt", "invalid_value"),
    ("too many prompts", "/v1/completions", completion(prompt=["a"] * 129), "prompt", "invalid_value"),
    ("logprobs above 20", "/v1/completions", completion(logprobs=21), "logprobs", "invalid_value"),
    ("negative logprobs", "/v1/completions", completion(logprobs=-1), "logprobs", "invalid_value"),
    ("top_logprobs above 20", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs",
     "invalid_value"),
    ("top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=3), "top_logprobs",
     "invalid_value"),
    ("best_of below n", "/v1/completions", completion(best_of=2, n=3), "best_of", "invalid_value"),
    ("best_of above n streamed", "/v1/completions", completion(best_of=3, n=2, stream=True), "best_of",
     "invalid_value"),
    ("best_of above 16", "/v1/completions", completion(best_of=17), "best_of", "invalid_value"),
    ("tools on a chat template without them", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools",
     "unsupported_parameter"),
    ("tool_choice required without tools", "/v1/chat/completions", chat(tool_choice="required"), "tool_choice",
     "invalid_value"),
    ("tool_choice naming no tool", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice", "invalid_value"),
    ("functions", "/v1/chat/completions", chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
    ("frequency_penalty above 2", "/v1/completions", completion(frequency_penalty=2.5), "frequency_penalty",
     "invalid_value"),
    ("presence_penalty below -2", "/v1/chat/completions", chat(presence_penalty=-3), "presence_penalty",
     "invalid_value"),
    ("repetition_penalty 0", "/v1/completions", completion(repetition_penalty=0), "repetition_penalty",
     "invalid_value"),
    ("logit_bias key not a token id", "/v1/completions", completion(logit_bias={"hello": 1}), "logit_bias",
     "invalid_value"),
    ("logit_bias above 100", "/v1/completions", completion(logit_bias={"50": 101}), "logit_bias",
     "invalid_value"),
    ("logit_bias past the vocabulary", "/v1/completions", completion(logit_bias={"49152": 1}), "logit_bias",
     "invalid_value"),
    ("negative min_tokens", "/v1/completions", completion(min_tokens=-1), "min_tokens", "invalid_value"),
    ("stop_token_ids not ids", "/v1/completions", completion(stop_token_ids=[-1]), "stop_token_ids.0",
     "invalid_value"),
    ("response_format schema that does not compile", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format", "invalid_value"),
    ("response_format regex that does not compile", "/v1/completions",
     completion(response_format={"type": "regex", "regex": "a(b"}), "response_format", "invalid_value"),
    ("response_format grammar that does not compile", "/v1/completions",
     completion(response_format={"type": "grammar", "grammar": "start: undefined_rule"}), "response_format",
     "invalid_value"),
    ("response_format json_schema without its schema", "/v1/chat/completions",
     chat(response_format={"type": "json_schema"}), "response_format", "invalid_value"),
    ("response_format of an unknown type", "/v1/chat/completions", chat(response_format={"type": "xml"}),
     "response_format.type", "invalid_value"),
    ("n above 16", "/v1/chat/completions", chat(n=17), "n", "invalid_value"),
    ("n 0", "/v1/completions", completion(n=0), "n", "invalid_value"),
    # vLLM's structured-output fields (response_format.vllm_format): the 400 names the field the client sent
    ("guided_regex that does not compile", "/v1/completions", completion(guided_regex="a(b"), "guided_regex",
     "invalid_value"),
    ("guided_json that is not JSON", "/v1/chat/completions", chat(guided_json="{not json"), "guided_json",
     "invalid_value"),
    ("guided_json schema that does not compile", "/v1/chat/completions", chat(guided_json={"type": "strin"}),
     "guided_json", "invalid_value"),
    ("guided_choice empty", "/v1/completions", completion(guided_choice=[]), "guided_choice", "invalid_value"),
    ("structured_outputs with two kinds", "/v1/chat/completions",
     chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "invalid_value"),
    ("response_format and guided_regex", "/v1/completions",
     completion(response_format={"type": "json_object"}, guided_regex="a"), None, "invalid_value"),
    ("guided_regex and guided_choice", "/v1/completions", completion(guided_regex="a", guided_choice=["b"]), None,
     "invalid_value"),
    ("five stop sequences", "/v1/completions", completion(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value"),
]


@pytest.mark.parametrize("what,path,body,param,code", BAD, ids=[b[0] for b in BAD])
def test_out_of_range_and_unsupported_parameters_are_400_naming_them(edge, what, path, body, param, code):
    r = post(edge, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err


def test_the_400s_say_what_to_change(edge):
    # a union's type errors ("Input should be a valid string") told a client with five stops nothing
    err = post(edge, "/v1/completions", completion(stop=["a", "b", "c", "d", "e"])).json()["error"]
    assert "at most 4 stop sequences" in err["message"], err
    err = post(edge, "/v1/completions", completion(response_format={"type": "json_object"},
                                                    guided_regex="a")).json()["error"]
    assert "response_format and guided_regex" in err["message"] and "send one" in err["message"], err


def test_a_schema_that_does_not_compile_is_refused_with_the_reason(edge):
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "no-such-format"}}}
    r = post(edge, "/v1/chat/completions",
             chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert r.status_code == 400 and "no-such-format" in r.json()["error"]["message"], r.text


NON_FINITE = [("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"), ("top_p", "-Infinity"),
              ("timeout", "Infinity"), ("frequency_penalty", "NaN")]


@pytest.mark.parametrize("field,literal", NON_FINITE, ids=[f"{f}={v}" for f, v in NON_FINITE])
def test_non_finite_numbers_are_400(edge, field, literal):
    # Python's JSON reader takes NaN and Infinity, which JSON itself does not have
    raw = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 2, "{field}": {literal}}}'
    r = httpx.post(edge["url"] + "/v1/completions", content=raw, timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_what_asks_for_nothing_unsupported_is_accepted(edge):
    # defaults that OpenAI's clients send: they reach the dispatcher (503: no engine here), not a 400
    for path, body in (("/v1/completions", completion(logprobs=None, best_of=1, frequency_penalty=0, logit_bias={},
                                                      suffix=None, echo=False, presence_penalty=None)),
                       ("/v1/completions", completion(prompt=[[1, 2, 3]], echo=True, max_tokens=0, logprobs=1)),
                       ("/v1/completions", completion(prompt=["a batch of one"])),
                       ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                     tool_choice="none")),
                       ("/v1/completions", completion(response_format={"type": "regex", "regex": "[0-9]+"})),
                       ("/v1/chat/completions", chat(response_format={"type": "json_object"})),
                       ("/v1/chat/completions", chat(response_format={
                           "type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {
                               "type": "object", "properties": {"a": {"type": "integer"}}}}})),
                       ("/v1/chat/completions", chat(logprobs=False, tools=[], tool_choice="none", presence_penalty=0.0,
                                                     response_format={"type": "text"},
                                                     messages=[{"role": "user", "content": [{"type": "text",
                                                                                             "text": "hi"}]}]))):
        r = post(edge, path, body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
    # the one message OpenAI lets have null content: an assistant turn that called tools
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    r = post(edge, "/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": None, "tool_calls": calls},
                                                          {"role": "user", "content": "and?"}]))
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text


def test_a_chat_template_that_refuses_the_messages_is_a_400_not_a_500(edge):
    # templates raise_exception on messages they do not take (Qwen3's, Mistral's); that reached the client as a 500
    state = edge["app"].state.hs
    real = state.tokenizer.chat_template
    state.tokenizer.chat_template = ("{% if messages[0]['role'] != 'system' %}"
                                     "{{ raise_exception('the first message must be a system message') }}{% endif %}"
                                     "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    try:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = post(edge, path, chat() if path != "/tokenize" else {"messages": chat()["messages"]})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["param"] == "messages" and "first message must be a system message" in err["message"], err
    finally:
        state.tokenizer.chat_template = real


# ---- tokenizing off the event loop ---------------------------------------------------------
def test_tokenizing_and_the_chat_template_run_off_the_event_loop(edge):
    state = edge["app"].state.hs
    real = state.tokenizer
    threads = []

    class Recording:
        """The real tokenizer, noting the thread of each call."""

        def __call__(self, *a, **kw):
            threads.append(threading.get_ident())
            return real(*a, **kw)

        def apply_chat_template(self, *a, **kw):
            threads.append(threading.get_ident())
            return real.apply_chat_template(*a, **kw)

        def __len__(self):
            return len(real)

        def __getattr__(self, name):
            return getattr(real, name)

    state.tokenizer = Recording()
    try:
        assert post(edge, "/v1/completions", completion()).status_code == 503
        assert post(edge, "/v1/chat/completions", chat()).status_code == 503
    finally:
        state.tokenizer = real
    assert len(threads) == 3  # the prompt; the chat template, then its text
    assert edge["loop_thread"].ident not in threads


def test_a_tokenization_that_hangs_does_not_stop_health_from_answering(edge):
    state = edge["app"].state.hs
    real, entered, release = state.tokenizer, threading.Event(), threading.Event()

    class Stuck:
        """The real tokenizer, held inside its call until the test lets it go."""

        def __call__(self, *a, **kw):
            entered.set()
            release.wait(120)
            return real(*a, **kw)

        def __len__(self):
            return len(real)

        def __getattr__(self, name):
            return getattr(real, name)

    state.tokenizer = Stuck()
    pending = {}
    worker = threading.Thread(target=lambda: pending.update(r=post(edge, "/v1/completions", completion())))
    try:
        worker.start()
        assert entered.wait(60), "the request never reached the tokenizer"
        health = httpx.get(edge["url"] + "/health", timeout=20)  # answered while the tokenizer is stuck
        body = health.json()  # no engine here: never ready, and it says what it waits on
        assert health.status_code == 503 and body["status"] == "starting" and not body["ready"]
        assert {"prefill_gpu", "decode_fpga", "calibration"} <= set(body["waiting_for"]), body
        assert not pending  # the completion is still inside its tokenization
    finally:
        release.set()
        worker.join(60)
        state.tokenizer = real
    assert pending["r"].status_code == 503  # then it went on to the dispatcher


# ---- uvicorn's limits from the settings ------------------------------------------------------
def test_uvicorn_gets_its_limits_from_the_settings():
    settings = GatewaySettings.from_environ({"HYBRIDSERVE_GATEWAY_LIMIT_CONCURRENCY": "7",
                                             "HYBRIDSERVE_GATEWAY_KEEP_ALIVE_TIMEOUT_S": "3",
                                             "HYBRIDSERVE_GATEWAY_BODY_READ_TIMEOUT_S": "9"})
    cfg = config(settings)
    assert (cfg.limit_concurrency, cfg.timeout_keep_alive) == (7, 3)
    assert settings.body_read_timeout_s == 9
