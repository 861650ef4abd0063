"""Scoring one structured-output reply: does its text parse as a closed JSON object, does that object
validate against the request's schema, and what JSON does a reply written without a grammar carry
(code fence stripped), so the two can be compared. Pure functions, no servers."""
from __future__ import annotations

import json
import re

import jsonschema

# a fenced block: ``` or ```json (any info string), then the body up to the closing fence
_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def parse_object(text: str) -> dict | None:
    """The JSON object the whole text is (whitespace around it allowed), or None: text that does not
    parse, stops before the object closes, carries anything after it, or is JSON but not an object."""
    try:
        value = json.loads(text)
    except (ValueError, TypeError):
        return None
    return value if isinstance(value, dict) else None


def schema_errors(value, schema: dict | None) -> str | None:
    """None when `value` validates against `schema` (no schema: any object), else the first error."""
    if schema is None:
        return None if isinstance(value, dict) else "not an object"
    validator = jsonschema.validators.validator_for(schema)(schema)
    error = next(iter(validator.iter_errors(value)), None)
    return None if error is None else error.message[:200]


def strip_fence(text: str) -> str:
    """The body of the first fenced code block (```json ... ```; an unclosed fence runs to the end), or
    the text itself when it has none: how a model without a grammar tends to wrap its JSON."""
    m = _FENCE.search(text)
    return m.group(1) if m else text


def json_in_reply(text: str) -> dict | None:
    """The first JSON object in a free reply: the fenced block's body when there is one, else the
    text; parsed whole, else from its first `{` as far as one object goes. None when there is none."""
    body = strip_fence(text).strip()
    whole = parse_object(body)
    if whole is not None:
        return whole
    decoder = json.JSONDecoder()
    for start in (i for i, c in enumerate(body) if c == "{"):
        try:
            value, _ = decoder.raw_decode(body, start)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def score(text: str, schema: dict | None) -> dict:
    """What a grammar-constrained reply achieved: `valid` (the whole text is one closed JSON object)
    and `schema_valid` (and it validates; for json_object, the same as valid), with the error."""
    value = parse_object(text)
    error = "not a closed JSON object" if value is None else schema_errors(value, schema)
    return {"valid": value is not None, "schema_valid": error is None, "error": error, "value": value}


def same_as_free(value: dict | None, free_text: str | None) -> bool | None:
    """Whether the constrained reply's object equals the JSON inside the same request's free reply
    (compared as values: whitespace and key order aside). None when either side carries no object."""
    if value is None or free_text is None:
        return None
    free = json_in_reply(free_text)
    return None if free is None else free == value
