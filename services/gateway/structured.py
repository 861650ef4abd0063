"""Structured outputs at the gateway: `response_format` into the grammar the engines mask tokens with.

The engines take an llguidance grammar (services/engine/grammar.py); this builds it from what the
client asked for and compiles it once here, so a schema, regex or grammar that cannot be compiled
is a 400 naming the reason before any engine sees the request:

    {"type": "json_object"}                                   any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}  JSON valid against `schema`
    {"type": "regex", "regex": "..."}                         extension: text matching the regex
    {"type": "grammar", "grammar": "..."}                     extension: a Lark grammar (llguidance's dialect)

JSON comes compact (`{"a":1,"b":[2,3]}`: no free whitespace between tokens): a small model left to
choose its whitespace can spend its whole budget on it. A schema may ask otherwise through
llguidance's own `x-guidance` key (e.g. `{"whitespace_flexible": true}`). The schema is enforced
whether or not `strict` is set.
"""
from __future__ import annotations

import json

import llguidance

from services.engine.grammar import check_grammar

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """The response format cannot be compiled; the message says why."""


def grammar_of(kind: str, schema: dict | None = None, regex: str | None = None, lark: str | None = None) -> str | None:
    """The llguidance grammar of a response format, checked; None for plain text. GrammarError when it
    does not compile."""
    M = llguidance.LLMatcher
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            grammar = M.grammar_from_json_schema({"type": "object"}, defaults=COMPACT_JSON)
        elif kind == "json_schema":
            grammar = M.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT_JSON)
        elif kind == "regex":
            grammar = M.grammar_from_regex(regex)
        elif kind == "grammar":
            grammar = M.grammar_from_lark(lark)
        else:
            raise GrammarError(f"unknown response format type {kind!r}")
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None
    reason = check_grammar(grammar)
    if reason:
        raise GrammarError(reason.strip())
    return grammar
