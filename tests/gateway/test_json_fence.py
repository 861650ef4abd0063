"""JSON output in a markdown fence: the grammar that allows it (the JSON alone or fenced, nothing else,
held to the schema either way) and the stripper that takes the fence off the client's text, however
the text is chunked. The live answers of the real model are in test_api_structured.py."""
from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest

from services.gateway.output.fence import FenceStripper
from services.gateway.protocol.response_format import ResponseFormat
from services.gateway.protocol.schemas import ChatCompletionRequest
from services.gateway.protocol.structured import GrammarError, fenced_json_grammar


def chunked(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def stripped(pieces: list[str]) -> str:
    fence = FenceStripper()
    return "".join(fence.feed(p) for p in pieces) + fence.flush()


JSON = '{\n  "to": "a@b.c",\n  "note": "x ``` y"\n}'


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 1000])
def test_the_fence_comes_off_and_plain_json_passes_whole_however_chunked(size):
    assert stripped(chunked("```json\n" + JSON + "\n```", size)) == JSON
    assert stripped(chunked(JSON, size)) == JSON
    # cut short by max_tokens inside the fence: the JSON so far, no fence
    assert stripped(chunked("```json\n" + JSON[:20], size)) == JSON[:20]
    assert stripped(chunked("```json\n" + JSON + "\n``", size)) == JSON


@pytest.mark.parametrize("partial", ["`", "``", "```", "```js", "```json"])
def test_an_opening_fence_cut_short_gives_no_text(partial):
    assert stripped([partial]) == ""


def test_newlines_inside_a_fence_are_held_only_until_they_are_clearly_json():
    fence = FenceStripper()
    assert fence.feed("```json\n{") == "{"
    assert fence.feed("\n") == ""  # may be the closing fence's
    assert fence.feed('  "a"') == '\n  "a"'
    assert fence.feed(": 1}\n`") == ": 1}"
    assert fence.feed("``") == "" and fence.feed("more") == ""


@pytest.fixture(scope="module")
def matcher_of():
    from services.model.checkpoint import locate
    from services.model.tokenizer import load_tokenizer

    hf = load_tokenizer(locate())
    tokenizer = llguidance.hf.from_tokenizer(hf)

    def accepts(grammar: str, text: str) -> tuple[bool, bool]:
        """(every token allowed, the grammar complete there)"""
        m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        ok = m.consume_tokens(hf(text, add_special_tokens=False)["input_ids"]) and not m.is_error()
        return ok, ok and m.is_accepting()
    return accepts


PERSON = {"type": "object", "additionalProperties": False, "required": ["name"],
          "properties": {"name": {"type": "string", "maxLength": 8}}}


def test_the_fenced_grammar_takes_json_alone_or_fenced_and_nothing_else(matcher_of):
    g = fenced_json_grammar("json_schema", PERSON)
    assert matcher_of(g, '{"name": "Ann"}') == (True, True)
    assert matcher_of(g, '```json\n{\n  "name": "Ann"\n}\n```') == (True, True)
    assert matcher_of(g, '```json\n{"name": "Ann"}') == (True, False)  # the fence must close
    for wrong in ['```\n{"name": "Ann"}\n```', '{"name": "Ann"}\n```', 'Sure: {"name": "Ann"}',
                  '```json\n{"name": "Annabelle Lee"}\n```', '```json\n{"age": 3}\n```']:
        assert matcher_of(g, wrong)[0] is False, wrong
    obj = fenced_json_grammar("json_object")
    assert matcher_of(obj, '```json\n{"a": [1, 2]}\n```') == (True, True)
    assert matcher_of(obj, '```json\n[1, 2]\n```')[0] is False


def test_compact_json_asked_by_the_schema_stays_compact_inside_the_fence(matcher_of):
    g = fenced_json_grammar("json_schema", {**PERSON, "x-guidance": {"whitespace_flexible": False}})
    assert matcher_of(g, '```json\n{"name":"Ann"}\n```') == (True, True)
    assert matcher_of(g, '```json\n{"name": "Ann"}\n```')[0] is False


def test_a_schema_that_does_not_compile_is_an_error_fenced_too():
    with pytest.raises(GrammarError, match="objectx"):
        fenced_json_grammar("json_schema", {"type": "objectx"})
    with pytest.raises(GrammarError):
        fenced_json_grammar("regex")


def test_only_json_formats_get_the_fence_and_the_setting_turns_it_off():
    def body(fmt):
        return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     "response_format": fmt})
    schema = body({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert schema.fenced_grammar(True) == schema.response_format.fenced != schema.grammar
    assert "```json" in schema.fenced_grammar(True)
    assert schema.fenced_grammar(False) == schema.grammar and "```" not in schema.grammar
    regex = body({"type": "regex", "regex": "[a-z]+"})
    assert regex.fenced_grammar(True) == regex.grammar and regex.response_format.fenced is None
    assert body({"type": "text"}).fenced_grammar(True) is None
    vllm = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "guided_json": json.dumps(PERSON)})
    assert "```json" in vllm.fenced_grammar(True)
    assert ResponseFormat.model_validate({"type": "json_object"}).fenced.startswith("start:")
