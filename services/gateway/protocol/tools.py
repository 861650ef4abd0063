"""Tool calls on chat: `tools` rendered through the checkpoint's chat template, the model's calls
parsed out of its text, and `tool_choice` `required` or a named function enforced by a grammar.

The call format is Hermes's, which Qwen2.5's template asks for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* A checkpoint whose chat template never mentions `tools` cannot be told about them: a request with
  tools (and a `tool_choice` other than `none`) is a 400 naming `tools`, never a prompt without them.
* `tool_choice: none` leaves the tools out of the prompt; `auto` (the default with tools) lets the
  model answer or call; `required` and a named function make the output one call, through the same
  grammar path as `response_format` (the call's JSON valid against the function's `parameters`).
* Each `<tool_call>` block whose JSON names a declared function becomes one of `message.tool_calls`
  (`arguments` as a JSON string, as OpenAI gives them) and the finish reason `tool_calls`; the text
  around the blocks, if any, stays `content`.
"""
from __future__ import annotations

import json
import re
import uuid

from services.gateway.protocol.openai_format import AssistantMessage, ToolCall
from services.gateway.protocol.structured import BOUNDED_JSON, GrammarError, grammar_of

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template_takes_tools(tokenizer) -> bool:
    """Whether the checkpoint's chat template renders a `tools` list at all."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def _call_schema(function: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": function["name"]},
                           "arguments": function.get("parameters") or {"type": "object"}}}


def call_grammar(functions: list[dict], name: str | None = None) -> str:
    """The llguidance grammar of exactly one call: of the function `name`, or of any of `functions`.
    GrammarError when a function's parameters cannot be compiled."""
    chosen = [f for f in functions if name is None or f["name"] == name]
    schema = _call_schema(chosen[0]) if len(chosen) == 1 else {"anyOf": [_call_schema(f) for f in chosen]}
    schema["x-guidance"] = BOUNDED_JSON
    lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'
    return grammar_of("grammar", lark=lark)


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(the content left, the calls) of a model's output; no calls when no block names a declared function
    with a JSON object of arguments (the text is then all content)."""
    calls = []
    for block in _CALL.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
            return text, []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return rest or None, calls


def assistant_message(text: str, finish_reason: str | None, tool_names: set[str] | None
                      ) -> tuple[AssistantMessage, str | None]:
    """A chat choice's message and finish reason: its calls of the offered tools taken out of its text."""
    if tool_names:
        content, calls = parse_tool_calls(text, tool_names)
        if calls:
            return AssistantMessage(content=content, tool_calls=[ToolCall(**c) for c in calls]), "tool_calls"
    return AssistantMessage(content=text), finish_reason


def template_messages(messages) -> list[dict]:
    """The request's messages as chat templates read them: an assistant's earlier calls with their
    arguments as objects (Qwen's template writes them with `tojson`), a tool's answer with its call id."""
    out = []
    for msg in messages:
        m = {"role": "system" if msg.role == "developer" else msg.role, "content": msg.text()}
        if msg.tool_calls:
            m["tool_calls"] = [_with_object_arguments(c) for c in msg.tool_calls]
        if msg.tool_call_id:
            m["tool_call_id"] = msg.tool_call_id
        out.append(m)
    return out


def _with_object_arguments(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {**call, "function": fn}


__all__ = ["GrammarError", "assistant_message", "call_grammar", "parse_tool_calls", "template_messages",
           "template_takes_tools"]
