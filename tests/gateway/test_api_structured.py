"""Structured outputs through the real stack in every mode: response_format json_object, json_schema
(strict) and the regex extension, streamed and not, chat and completions, and vLLM's names for them
(guided_*, structured_outputs); the output parses, validates and is the same in every mode (greedy); JSON the
model puts in a markdown fence comes back without it, and a gateway set not to allow the fence makes none.
The 400s for formats that do not compile are in test_edge.py."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services.gateway.settings import GatewaySettings
from services.modes import MODE_NAMES
from tests.gateway.conftest import API_KEY
from tests.gateway.test_api_logprobs import post, stream
from tests.services_harness import start_gateway, wait_http_ok

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
ASK_PERSON = [{"role": "user", "content": "Give a person as JSON."}]


def test_json_schema_output_validates_and_is_the_same_in_every_mode(stack):
    texts = {}
    for mode in MODE_NAMES:
        body = post(stack, "/v1/chat/completions", {"messages": ASK_PERSON, "max_tokens": 40, "temperature": 0,
                                                    "response_format": PERSON_FORMAT, "mode": mode})
        choice = body["choices"][0]
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        assert choice["finish_reason"] == "stop", (mode, choice)
        texts[mode] = choice["message"]["content"]
    assert len(set(texts.values())) == 1, texts


def test_json_object_closes_where_compact_json_nested_until_max_tokens(stack, tmp_path):
    # compact JSON masked every token with the space or newline the model puts after `{"name":`; greedy then
    # took `{` and nested {"name":{"name":... until max_tokens in every mode (issue 53). Here the whitespace
    # alone, on a gateway of its own without the markdown fence (HYBRIDSERVE_GATEWAY_JSON_FENCE=false): with
    # the fence, this prompt's greedy path parts at an indent whose two choices are 0.06 nats apart, and the
    # path the fenced reply takes nests (docs/structured-outputs.md)
    gateway = start_gateway(tmp_path, stack["prefill"], stack["decode"],
                            {"HYBRIDSERVE_API_KEY": API_KEY, GatewaySettings.env_name("json_fence"): "false"})
    try:
        wait_http_ok(gateway)
        own = {"url": f"http://127.0.0.1:{gateway.port}"}
        messages = [{"role": "user", "content": "Reply in JSON: your name."}]
        texts = {}
        for mode in MODE_NAMES:
            choice = post(own, "/v1/chat/completions", {"messages": messages, "max_tokens": 120, "temperature": 0,
                                                        "response_format": {"type": "json_object"}, "logprobs": True,
                                                        "mode": mode})["choices"][0]
            text = choice["message"]["content"]
            assert choice["finish_reason"] == "stop", (mode, text)
            assert isinstance(json.loads(text), dict) and "{\"name\":{" not in text.replace(" ", ""), (mode, text)
            assert "".join(t["token"] for t in choice["logprobs"]["content"]) == text  # no fence made
            texts[mode] = text
        assert len(set(texts.values())) == 1, texts
    finally:
        gateway.stop()


EMAIL = {"type": "object", "additionalProperties": False, "required": ["to", "subject", "body"],
         "properties": {"to": {"type": "string", "maxLength": 32}, "subject": {"type": "string", "maxLength": 40},
                        "body": {"type": "string", "maxLength": 120}}}


def test_json_the_model_fences_closes_and_comes_back_without_its_fence(stack):
    # the model's likeliest first token here is "```" (a markdown fence). Held to `{`, greedy then filled
    # "to" with 🌱 until max_tokens in every mode; allowed its fence, it writes a closed email (issue 53).
    # The streamed text must equal the whole one: the fence comes off across chunks too
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer with JSON."},
                {"role": "user", "content": "Write a short email to a friend as JSON."}]
    body = {"messages": messages, "max_tokens": 160, "temperature": 0, "logprobs": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "email", "schema": EMAIL}}}
    texts = {}
    for mode in ("fpga", "hybrid"):  # the two fast ones on a CPU: every mode's identity is tested above
        choice = post(stack, "/v1/chat/completions", {**body, "mode": mode})["choices"][0]
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", (mode, text)
        jsonschema.validate(json.loads(text), EMAIL)
        assert text.startswith("{") and text.endswith("}"), (mode, text)
        made = "".join(t["token"] for t in choice["logprobs"]["content"])
        assert made.startswith("```json\n") and made.endswith("\n```"), made  # the fence was the model's
        texts[mode] = text
    assert len(set(texts.values())) == 1, texts
    events = stream(stack, "/v1/chat/completions", {**body, "mode": "fpga"})
    assert "".join(ch["delta"].get("content") or "" for e in events for ch in e["choices"]) == texts["fpga"]


def test_streamed_json_object_parses_in_every_mode(stack):
    messages = [{"role": "user", "content": "Reply with a JSON object with a key \"colour\" and a colour as its value."}]
    texts = {}
    for mode in MODE_NAMES:
        events = stream(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 40, "temperature": 0,
                                                        "response_format": {"type": "json_object"}, "mode": mode})
        text = "".join(ch["delta"].get("content") or "" for e in events for ch in e["choices"])
        assert isinstance(json.loads(text), dict), (mode, text)
        assert events[-1]["choices"][0]["finish_reason"] == "stop", mode
        texts[mode] = text
    assert len(set(texts.values())) == 1, texts


def test_regex_completion_matches_streamed_or_not_in_every_mode(stack):
    pattern = "[0-9]{3}-[a-z]{2,4}"
    fmt = {"type": "regex", "regex": pattern}
    for mode in MODE_NAMES:
        body = {"prompt": "Order number:", "max_tokens": 20, "temperature": 0, "response_format": fmt, "mode": mode}
        choice = post(stack, "/v1/completions", body)["choices"][0]
        assert re.fullmatch(pattern, choice["text"]) and choice["finish_reason"] == "stop", (mode, choice)
        events = stream(stack, "/v1/completions", body)
        assert "".join(ch["text"] for e in events for ch in e["choices"]) == choice["text"], mode


def test_each_sampled_choice_follows_the_schema(stack):
    # n choices, each its own matcher; sampled, so they differ in more than whitespace
    body = post(stack, "/v1/chat/completions", {"messages": ASK_PERSON, "max_tokens": 40, "temperature": 1.0,
                                                "seed": 3, "n": 3, "response_format": PERSON_FORMAT,
                                                "mode": "hybrid"})
    for choice in body["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_vllm_guided_fields_constrain_the_output_as_response_format_does(stack):
    # a vLLM client's body, unchanged: before these fields were read they were ignored, and the text was free
    choices = ["Paris", "Lyon", "a city (none of these)"]
    for mode in MODE_NAMES:
        text = post(stack, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                                               "guided_choice": choices, "mode": mode})["choices"][0]["text"]
        assert text in choices, (mode, text)
    pattern = "[0-9]{3}-[a-z]{2,4}"
    body = {"prompt": "Order number:", "max_tokens": 20, "temperature": 0, "mode": "hybrid"}
    guided = post(stack, "/v1/completions", {**body, "guided_regex": pattern})["choices"][0]["text"]
    as_format = post(stack, "/v1/completions", {**body, "response_format": {"type": "regex", "regex": pattern}})
    assert re.fullmatch(pattern, guided) and guided == as_format["choices"][0]["text"], guided
    content = post(stack, "/v1/chat/completions", {"messages": ASK_PERSON, "max_tokens": 40, "temperature": 0,
                                                   "structured_outputs": {"json": PERSON}, "mode": "fpga"})
    jsonschema.validate(json.loads(content["choices"][0]["message"]["content"]), PERSON)
