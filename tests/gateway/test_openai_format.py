"""The exact JSON the gateway sends: stream chunks, the usage chunk, unary bodies, errors.

The `openai` client parses these in test_api.py; here the bytes themselves are pinned, so a
change of shape (a field renamed, a null where OpenAI leaves a key out) shows up at once.
"""
from __future__ import annotations

import json

from services.gateway.protocol.errors import APIError, error_response
from services.gateway.protocol.openai_format import (SSE_DONE, AssistantMessage, ChatChoice, ChatCompletion,
                                                     ChunkWriter, Completion, CompletionChoice, Hybridserve, ModelCard,
                                                     ModelList, Timings, Usage, sse)

TIMINGS = Timings(queue_s=0.0, prefill_s=0.25, handoff_total_s=0.125, handoff_exposed_s=0.0625, decode_s=0.5,
                  decode_tokens=3, handoff_bytes=4096, cached_tokens=16, e2e_s=1.0)
EXT = Hybridserve(mode="hybrid", reason="auto", estimates={"gpu": 1.5, "fpga": 2.0, "hybrid": 1.25}, timings=TIMINGS)
EXT_JSON = ('{"mode":"hybrid","reason":"auto","estimates":{"gpu":1.5,"fpga":2.0,"hybrid":1.25},'
            '"timings":{"queue_s":0.0,"prefill_s":0.25,"handoff_total_s":0.125,"handoff_exposed_s":0.0625,'
            '"decode_s":0.5,"decode_tokens":3,"handoff_bytes":4096,"cached_tokens":16,"draft_tokens":0,"accepted_draft_tokens":0,"e2e_s":1.0}}')
HEAD = '"id":"cmpl-7","object":"text_completion","created":1700000000,"model":"smol"'
CHAT_HEAD = '"id":"chatcmpl-7","object":"chat.completion.chunk","created":1700000000,"model":"smol"'


def completion_chunks() -> ChunkWriter:
    return ChunkWriter("cmpl-7", "smol", 1700000000, chat=False)


def chat_chunks() -> ChunkWriter:
    return ChunkWriter("chatcmpl-7", "smol", 1700000000, chat=True)


def test_a_completion_text_chunk():
    assert sse(completion_chunks().text("Paris")) == (
        'data: {' + HEAD + ',"choices":[{"index":0,"text":"Paris","finish_reason":null,"logprobs":null}]}\n\n')


def test_chat_chunks_open_with_the_role_then_carry_content_deltas():
    chunks = chat_chunks()
    assert sse(chunks.role()) == ('data: {' + CHAT_HEAD + ',"choices":[{"index":0,"delta":{"role":"assistant",'
                                  '"content":""},"finish_reason":null,"logprobs":null}]}\n\n')
    assert sse(chunks.text("Par")) == ('data: {' + CHAT_HEAD + ',"choices":[{"index":0,"delta":{"content":"Par"},'
                                       '"finish_reason":null,"logprobs":null}]}\n\n')


def test_the_finish_chunks_carry_the_reason_and_the_hybridserve_object():
    assert completion_chunks().finish("length", EXT).model_dump_json() == (
        '{' + HEAD + ',"choices":[{"index":0,"text":"","finish_reason":"length","logprobs":null}],'
        '"hybridserve":' + EXT_JSON + '}')
    assert chat_chunks().finish("stop", EXT).model_dump_json() == (
        '{' + CHAT_HEAD + ',"choices":[{"index":0,"delta":{},"finish_reason":"stop","logprobs":null}],'
        '"hybridserve":' + EXT_JSON + '}')


def test_the_usage_chunk_has_no_choices_and_the_stream_ends_with_done():
    usage = Usage.of(5, 10)
    assert usage.total_tokens == 15
    assert sse(completion_chunks().usage(usage)) == (
        'data: {' + HEAD + ',"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":10,"total_tokens":15}}\n\n')
    assert json.loads(chat_chunks().usage(usage).model_dump_json())["object"] == "chat.completion.chunk"
    assert SSE_DONE == "data: [DONE]\n\n"


def test_unary_bodies():
    usage = Usage.of(5, 2)
    completion = Completion(id="cmpl-7", created=1700000000, model="smol", usage=usage, hybridserve=EXT,
                            choices=[CompletionChoice(text=" Paris.", finish_reason="length")])
    assert completion.model_dump_json() == (
        '{' + HEAD + ',"choices":[{"index":0,"text":" Paris.","finish_reason":"length","logprobs":null}],'
        '"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7},"hybridserve":' + EXT_JSON + '}')
    chat = ChatCompletion(id="chatcmpl-7", created=1700000000, model="smol", usage=usage, hybridserve=EXT,
                          choices=[ChatChoice(message=AssistantMessage(content="Paris."), finish_reason="stop")])
    assert json.loads(chat.model_dump_json())["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop", "logprobs": None}]
    assert json.loads(chat.model_dump_json())["object"] == "chat.completion"


def test_the_model_list():
    assert ModelList(data=[ModelCard(id="smol")]).model_dump_json() == (
        '{"object":"list","data":[{"id":"smol","object":"model","created":0,"owned_by":"hybridserve"}]}')


def test_an_error_is_the_same_shape_unary_and_in_a_stream():
    err = APIError(504, "the request did not finish within its timeout", code="timeout")
    assert sse(err.body()) == ('data: {"error":{"message":"the request did not finish within its timeout",'
                               '"type":"timeout_error","param":null,"code":"timeout"}}\n\n')
    response = error_response(err.status, err.message, err.param, err.code)
    assert response.status_code == 504 and json.loads(response.body) == err.body().model_dump()


def test_an_error_type_follows_its_status():
    kinds = {status: APIError(status, "m").body().error.type for status in (400, 401, 404, 429, 500, 502, 503, 418)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                     429: "rate_limit_error", 500: "server_error", 502: "server_error",
                     503: "service_unavailable_error", 418: "api_error"}


def test_usage_names_drafted_tokens_only_when_the_engine_drafted():
    assert Usage.of(5, 7).model_dump_json() == '{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}'
    assert Usage.of(5, 7, drafted=9, accepted=4).model_dump_json() == (
        '{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12,'
        '"completion_tokens_details":{"accepted_prediction_tokens":4,"rejected_prediction_tokens":5}}')
