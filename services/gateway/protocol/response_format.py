"""What the output must be: OpenAI's `response_format` and vLLM's spellings of it (`guided_*`,
`structured_outputs`), each compiled to the engines' grammar (structured.py) when the body is
validated, so one that cannot be compiled is a 400 naming its field."""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from services.gateway.protocol.fields import NonEmptyText, Text
from services.gateway.protocol.structured import JSON_KINDS, GrammarError, fenced_json_grammar, grammar_of


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Text = Field("response", max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema the output must validate against")
    strict: bool | None = Field(None, description="the schema is enforced either way")


class ResponseFormat(BaseModel):
    """What the output must be (services/gateway/protocol/structured.py): plain text, any JSON object, JSON valid
    against a schema, or (extensions) text matching a regex or a Lark grammar. Compiled here: one that
    cannot be is a 400 with `param: response_format` and the reason."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: Text | None = Field(None, description="extension: with type `regex`, the regex the whole output matches")
    grammar: Text | None = Field(None, description=(
        "extension: with type `grammar`, a Lark grammar (llguidance's dialect) the output follows"))
    _compiled: str | None = PrivateAttr(None)
    _fenced: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _compile(self):
        needs = {"json_schema": self.json_schema, "regex": self.regex, "grammar": self.grammar}
        if self.type in needs and needs[self.type] is None:
            raise PydanticCustomError("invalid_value", "type {kind} needs its `{kind}` field", {"kind": self.type})
        try:
            schema = self.json_schema.schema_ if self.json_schema else None
            self._compiled = grammar_of(self.type, schema, self.regex, self.grammar)
            if self.type in JSON_KINDS:
                self._fenced = fenced_json_grammar(self.type, schema)
        except GrammarError as exc:
            raise PydanticCustomError("invalid_value", "cannot be compiled: {reason}", {"reason": str(exc)}) from None
        return self

    @property
    def compiled(self) -> str | None:
        """The llguidance grammar the engines mask with; None for plain text."""
        return self._compiled

    @property
    def fenced(self) -> str | None:
        """For JSON, the grammar that also allows the JSON in a markdown fence (structured.py); else None."""
        return self._fenced


# Rust regex's meta characters (llguidance's regexes): escaped, a choice is matched as written
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _literal_regex(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def vllm_format(kind: str, value: Any) -> dict:
    """vLLM's structured-output request (`guided_<kind>`, or `structured_outputs: {kind: value}`) as the
    `response_format` that means the same: json (a schema, or its JSON text), regex, choice (one of
    these strings), grammar (read as Lark), json_object."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("the schema is not valid JSON") from None
        if not isinstance(value, dict):
            raise ValueError("the schema must be a JSON object")
        return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": value}}
    if kind == "regex":
        return {"type": "regex", "regex": value}
    if kind == "choice":
        return {"type": "regex", "regex": "|".join(_literal_regex(c) for c in value)}
    if kind == "grammar":
        return {"type": "grammar", "grammar": value}
    if kind == "json_object":
        return {"type": "json_object" if value else "text"}
    raise ValueError(f"unknown structured output {kind!r}")


def compiled_format(kind: str, value: Any) -> ResponseFormat:
    """vllm_format's ResponseFormat, compiled; its error a ValueError (the field's own 400). Read-only
    and cached by value: the field's check and the body's use compile it once, and a client that
    sends the same schema with every request has it compiled once."""
    return _compiled_cached(kind, json.dumps(value, sort_keys=True))


@lru_cache(maxsize=64)
def _compiled_cached(kind: str, value_json: str) -> ResponseFormat:
    try:
        return ResponseFormat.model_validate(vllm_format(kind, json.loads(value_json)))
    except ValidationError as exc:
        raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its newer spelling of the guided_* fields): one of these."""

    model_config = ConfigDict(extra="ignore")
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    _format: ResponseFormat | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one(self):
        given = {k: v for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                   ("grammar", self.grammar), ("json_object", self.json_object)) if v is not None}
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got {sorted(given)})")
        self._format = compiled_format(*next(iter(given.items())))
        return self


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
