"""Structured outputs at the gateway: `response_format` into the grammar the engines mask tokens with.

The engines take an llguidance grammar (services/engine/grammar.py); this builds it from what the
client asked for and compiles it once here, so a schema, regex or grammar that cannot be compiled
is a 400 naming the reason before any engine sees the request:

    {"type": "json_object"}                                   any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}  JSON valid against `schema`
    {"type": "regex", "regex": "..."}                         extension: text matching the regex
    {"type": "grammar", "grammar": "..."}                     extension: a Lark grammar (llguidance's dialect)

JSON may carry bounded whitespace where JSON allows it: at most one space, or one newline and an
indent of up to 20 spaces or tabs (llama.cpp's JSON grammar bounds it the same way). A small model's
natural next token after `{"name":` carries a leading space or newline; forcing JSON compact masked
all of those, and the default model's best token left was `{`, nesting `{"name":{"name":...` until
max_tokens ran out. Bounded, it cannot spend its budget on whitespace either. A schema may still ask
for compact JSON through llguidance's own `x-guidance` key (`COMPACT_JSON` below, e.g.
`{"type": "object", "x-guidance": {"whitespace_flexible": false}}`). The schema is enforced whether
or not `strict` is set.

JSON may also come inside a markdown fence ("```json", a newline, the JSON, a newline, "```"), which
the gateway takes off the text (output/fence.py): `fenced_json_grammar`, the gateway's default
(HYBRIDSERVE_GATEWAY_JSON_FENCE). Chat models put JSON in a fence by habit: asked for JSON without a
grammar, the default model fences 9 of the evaluation's 34 replies, and where it does, a fence is its
likeliest first token. Forbidding the fence moves the model off its own path at the first
token, and on some prompts it then loops where, fenced, it closes its object (docs/structured-outputs.md
has the evaluation). llama-server lets the model fence its JSON and gives the content without it in
the same way.
"""
from __future__ import annotations

import json

import llguidance

from services.engine.grammar import check_grammar

# one optional space, or a newline and an indent of at most 20: where JSON allows whitespace
BOUNDED_JSON = {"whitespace_flexible": True, "whitespace_pattern": r"[ ]?|\n[ \t]{0,20}"}
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """The response format cannot be compiled; the message says why."""


def _json_defaults(schema) -> dict:
    """The whitespace a schema's JSON takes: bounded, unless its `x-guidance` turns flexible whitespace off
    (llguidance lays `x-guidance` over these defaults, and a pattern left from them would still apply)."""
    own = schema.get("x-guidance") if isinstance(schema, dict) else None
    return COMPACT_JSON if isinstance(own, dict) and own.get("whitespace_flexible") is False else BOUNDED_JSON


JSON_KINDS = frozenset({"json_object", "json_schema"})
# the JSON alone, or the JSON in a markdown fence (output/fence.py takes the fence off the text)
_FENCED = 'start: json | "```json\\n" json "\\n```"\njson: %json '


def _with_defaults(kind: str, schema: dict | None) -> dict:
    """The schema of a JSON kind, with the whitespace it takes (as `_json_defaults`) in its `x-guidance`."""
    schema = {"type": "object"} if kind == "json_object" else dict(schema)
    own = schema.get("x-guidance")
    schema["x-guidance"] = {**_json_defaults(schema), **(own if isinstance(own, dict) else {})}
    return schema


def fenced_json_grammar(kind: str, schema: dict | None = None) -> str:
    """The llguidance grammar of a JSON response format that also allows the JSON in a markdown fence,
    checked. GrammarError when it does not compile."""
    if kind not in JSON_KINDS:
        raise GrammarError(f"response format {kind!r} is not JSON")
    return _checked(lambda: llguidance.LLMatcher.grammar_from_lark(_FENCED + json.dumps(_with_defaults(kind, schema))))


def _checked(build) -> str:
    """The grammar `build` makes, compiled once to check it; its failure a GrammarError with the reason."""
    try:
        grammar = build()
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None
    reason = check_grammar(grammar)
    if reason:
        raise GrammarError(reason.strip())
    return grammar


def grammar_of(kind: str, schema: dict | None = None, regex: str | None = None, lark: str | None = None) -> str | None:
    """The llguidance grammar of a response format, checked; None for plain text. GrammarError when it
    does not compile."""
    M = llguidance.LLMatcher
    builds = {"json_object": lambda: M.grammar_from_json_schema({"type": "object"}, defaults=BOUNDED_JSON),
              "json_schema": lambda: M.grammar_from_json_schema(json.dumps(schema), defaults=_json_defaults(schema)),
              "regex": lambda: M.grammar_from_regex(regex),
              "grammar": lambda: M.grammar_from_lark(lark)}
    if kind == "text":
        return None
    if kind not in builds:
        raise GrammarError(f"unknown response format type {kind!r}")
    return _checked(builds[kind])
