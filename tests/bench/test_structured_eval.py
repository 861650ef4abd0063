"""The structured-outputs evaluation's pure parts (bench/structured/): scoring a reply (closed object,
schema-valid), the JSON in a free reply (fence stripped), the comparison, the rates and the checks,
and the prompts file itself. No servers."""
from __future__ import annotations

import pytest

from bench.structured.report import checks, scored, summary
from bench.structured.requests import VARIANTS, Prompt, load_prompts, request_body, response_format
from bench.structured.score import json_in_reply, parse_object, same_as_free, schema_errors, score, strip_fence

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}}}


def test_only_a_whole_closed_object_parses():
    assert parse_object('{\n    "name": "Mara"\n}\n') == {"name": "Mara"}
    assert parse_object('{"name":{"name":{"name":') is None  # cut at max_tokens
    assert parse_object('{"a": 1} trailing') is None
    assert parse_object('[1, 2]') is None and parse_object('"x"') is None and parse_object("") is None


def test_schema_validity_names_the_error_and_json_object_takes_any_object():
    assert schema_errors({"name": "Ann", "age": 30}, PERSON) is None
    assert "age" in schema_errors({"name": "Ann"}, PERSON)
    assert schema_errors({"name": "Ann", "age": -1}, PERSON) is not None
    assert schema_errors({"name": "Ann", "age": 3, "x": 1}, PERSON) is not None
    assert schema_errors({"anything": [1]}, None) is None
    assert schema_errors([1], None) == "not an object"


def test_score_separates_valid_from_schema_valid():
    assert score('{"name": "Ann", "age": 30}', PERSON) == {"valid": True, "schema_valid": True, "error": None,
                                                            "value": {"name": "Ann", "age": 30}}
    s = score('{"name": "Ann"}', PERSON)
    assert s["valid"] and not s["schema_valid"] and "age" in s["error"]
    s = score('{"name": "Ann", "age": 3', PERSON)
    assert not s["valid"] and not s["schema_valid"] and s["value"] is None


def test_fences_are_stripped_with_or_without_an_info_string_or_a_close():
    assert strip_fence('Sure!\n```json\n{"a": 1}\n```\nDone.') == '{"a": 1}\n'
    assert strip_fence('```\n{"a": 1}\n```') == '{"a": 1}\n'
    assert strip_fence('```json\n{"a": 1}') == '{"a": 1}'  # cut at max_tokens inside the fence
    assert strip_fence('{"a": 1}') == '{"a": 1}'


def test_json_in_a_free_reply_is_found_in_a_fence_or_in_prose():
    assert json_in_reply('```json\n{\n  "name": "MaraKara"\n}\n```') == {"name": "MaraKara"}
    assert json_in_reply('Here it is: {"a": {"b": [1, 2]}} hope it helps') == {"a": {"b": [1, 2]}}
    assert json_in_reply('first {not json} then {"ok": true}') == {"ok": True}
    assert json_in_reply("I cannot answer that.") is None
    assert json_in_reply('```json\n{"a": [1, 2') is None


def test_same_as_free_compares_values_not_whitespace():
    assert same_as_free({"a": 1, "b": 2}, '```json\n{ "b": 2,\n  "a": 1 }\n```') is True
    assert same_as_free({"a": 1}, '{"a": 2}') is False
    assert same_as_free({"a": 1}, "no json here") is None
    assert same_as_free(None, '{"a": 1}') is None


def test_request_bodies_differ_only_in_the_format_and_sampling():
    p = Prompt("person", "flat", "json_schema", "Give a person as JSON.", PERSON)
    free, greedy, sampled = (request_body(p, v, 64, seed=7) for v in VARIANTS)
    assert "response_format" not in free and free["temperature"] == 0
    assert greedy["response_format"] == response_format(p) == {
        "type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    assert free["messages"] == greedy["messages"] == sampled["messages"] and free["messages"][0]["role"] == "system"
    assert sampled["seed"] == 7 and sampled["temperature"] > 0 and "seed" not in greedy
    assert response_format(Prompt("o", "flat", "json_object", "x")) == {"type": "json_object"}
    with pytest.raises(ValueError):
        request_body(p, "beam", 64, seed=0)


def test_the_prompts_file_covers_the_shapes_and_its_schemas_are_valid():
    import jsonschema

    prompts = load_prompts()
    assert len(prompts) >= 30
    assert {p.shape for p in prompts} >= {"flat", "nested", "array", "numbers", "enum", "required"}
    kinds = [p.format for p in prompts]
    assert 0 < kinds.count("json_object") < kinds.count("json_schema")
    for p in prompts:
        if p.schema is not None:
            jsonschema.validators.validator_for(p.schema).check_schema(p.schema)


def reply(id_, variant, text, finish="stop", tokens=5):
    return {"id": id_, "variant": variant, "error": None, "text": text, "finish_reason": finish, "tokens": tokens,
            "itl": [0.01] * (tokens - 1)}


def test_rates_and_checks_catch_an_invalid_stop_and_a_worse_rate_than_the_baseline():
    prompts = [Prompt("p", "flat", "json_schema", "x", PERSON), Prompt("o", "flat", "json_object", "y")]
    good = {"free": [reply("p", "free", '```json\n{"name": "A", "age": 1}\n```'), reply("o", "free", "no")],
            "greedy": [reply("p", "greedy", '{"name": "A", "age": 1}'), reply("o", "greedy", '{"k": 1}')]}
    bad = {"free": good["free"],
           "greedy": [reply("p", "greedy", '{"name": "A"}'),  # stopped, yet not schema-valid
                      reply("o", "greedy", '{"k":{"k":{"k":', finish="length", tokens=9)]}
    rows = {"ours": scored(prompts, bad), "llama-server": scored(prompts, good)}
    s = {name: summary(r, {"greedy": [0.01]}) for name, r in rows.items()}
    assert s["llama-server"]["greedy"]["schema_valid"] == 1.0 and s["llama-server"]["greedy"]["same_as_free"] == 1.0
    assert s["llama-server"]["free"]["free_json"] == 0.5
    ours = s["ours"]["greedy"]
    assert (ours["valid"], ours["schema_valid"], ours["schema_valid_on_stop"], ours["length"]) == (0.5, 0.0, 0.0, 1)
    result = {c["check"]: c["ok"] for c in checks(s, "llama-server")}
    assert result == {"ours greedy: schema-valid whenever finish_reason is stop": False,
                      "ours greedy: schema-valid at least as often as llama-server": False,
                      "llama-server greedy: schema-valid whenever finish_reason is stop": True}
