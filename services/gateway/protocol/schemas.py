"""Request bodies of the OpenAI-compatible API (what we accept, validated).
(Past 300 lines on purpose: the completion and chat bodies and their validators, every field OpenAI and vLLM
clients send; the shared parts are already in the modules named below.)

The field types they share are in fields.py, `response_format` and vLLM's spellings of it in
response_format.py, a chat's messages and tools in chat_messages.py.

Unknown fields are ignored, as OpenAI-compatible servers do, and named (`ignored_fields`: the
response's x-hybridserve-ignored-fields header). Known fields that this stack cannot
honour (the deprecated functions and function_call, suffix) are refused with a
400 naming the field, never silently ignored. Numbers are bounded by
what the engines' wire holds (uint32 token counts and top_k, a uint64 seed) and must be finite;
text must be valid Unicode (no lone surrogates, which JSON's \\ud800 escapes can carry).
"""
from __future__ import annotations

import json
import re
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from services.engine.sampling import MAX_CHOICES
from services.gateway.protocol.chat_messages import ChatMessage, NamedToolChoice, Tool, check_continue
from services.gateway.protocol.fields import (UINT32_MAX, UINT64_MAX, ModeName, NonEmptyText, Text, TokenCount, TokenId,
                                              TopLogprobs, unsupported)
from services.gateway.protocol.response_format import GUIDED_FIELDS, ResponseFormat, StructuredOutputs, compiled_format
from services.modes import AUTO


class StreamOptions(BaseModel):
    include_usage: bool = False


_PLAIN_FIELD = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a field name a header may carry as sent


@cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    """The top-level names a body model reads: its fields and their aliases (once per model)."""
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data, handler):
        """The body's top-level fields this server does not read, kept to be said (`ignored_fields`): a
        client whose field is silently dropped (vLLM's guided_regex, before it was read here) gets other
        output than it asked for and no sign of why."""
        body = handler(data)
        if isinstance(data, dict):
            known = _field_names(cls)
            body._ignored = sorted(str(k) for k in data if k not in known)
        return body

    @property
    def ignored_fields(self) -> list[str]:
        return list(self._ignored)

    def ignored_header(self) -> str:
        """`ignored_fields` as the x-hybridserve-ignored-fields value: the plain names (a header is latin-1
        and bounded), at most 16, then how many more."""
        plain = [f for f in self._ignored if _PLAIN_FIELD.fullmatch(f)][:16]
        rest = len(self._ignored) - len(plain)
        return ",".join(plain + ([f"+{rest} more"] if rest else []))

    model: Text
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=UINT32_MAX)  # extension
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    stop: NonEmptyText | list[NonEmptyText] | None = None  # at most 4: _stop_list says so
    include_stop_str_in_output: bool = Field(False, description=(
        "extension (vLLM's): the stop string that ended the text is kept at its end"))
    n: int | None = Field(1, ge=1, le=MAX_CHOICES, description="choices, sharing the prompt's prefill")
    user: Text | None = None
    mode: ModeName = AUTO  # extension: force a mode
    ignore_eos: bool = False  # extension, for benchmarks
    speculative: bool = Field(True, description=(
        "extension: false keeps the engine from verifying draft tokens for this request (speculative decoding, "
        "when the engines have it on); the tokens are the same either way"))
    timeout: float | None = Field(None, gt=0)  # extension: seconds before 504
    # sampling controls (services/engine/logits_processing.py), applied the same in every mode
    # (None, as some clients send for "unset", is the default)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, description=(
        "subtracted from a token's logit once per time it was generated so far"))
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, description=(
        "subtracted from a token's logit once it was generated"))
    repetition_penalty: float | None = Field(1.0, gt=0.0, le=10.0, description=(
        "extension (vLLM's): a token in the prompt or the output has its logit divided by it when positive, "
        "multiplied when not; 1 = off"))
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, description=(
        "token id (a decimal string) → bias added to its logit"))
    min_tokens: int | None = Field(0, ge=0, le=UINT32_MAX, description=(
        "extension (vLLM's): EOS and the stop tokens cannot end the output before this many tokens"))
    stop_token_ids: list[TokenId] | None = Field(None, description=(
        "extension (vLLM's): token ids that end the output (finish_reason `stop`)"))
    response_format: ResponseFormat | None = None
    # vLLM's names for structured outputs, so its clients' requests mean the same here (vllm_format)
    guided_json: dict[str, Any] | Text | None = Field(None, description=(
        "extension (vLLM's): as response_format json_schema with this schema (an object, or its JSON text)"))
    guided_regex: Text | None = Field(None, description="extension (vLLM's): as response_format regex")
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = Field(None, description=(
        "extension (vLLM's): the output is exactly one of these strings"))
    guided_grammar: Text | None = Field(None, description=(
        "extension (vLLM's): as response_format grammar, a Lark grammar (llguidance's dialect; not GBNF)"))
    structured_outputs: StructuredOutputs | None = Field(None, description=(
        "extension (vLLM's): one of {json, regex, choice, grammar, json_object}, as the guided_* fields"))

    @field_validator("guided_json", "guided_regex", "guided_choice", "guided_grammar")
    @classmethod
    def _guided_compiles(cls, v, info):
        if v is not None:
            compiled_format(info.field_name.removeprefix("guided_"), v)  # its 400 names the field
        return v

    @model_validator(mode="after")
    def _guided_as_response_format(self):
        """A vLLM structured-output field becomes `response_format`; two ways of saying it are a 400."""
        given = [f for f in GUIDED_FIELDS if getattr(self, f) is not None]
        if not given:
            return self
        if len(given) > 1 or (self.response_format is not None and self.response_format.type != "text"):
            named = (["response_format"] if self.response_format is not None else []) + given
            raise ValueError(f"{' and '.join(named)} each say what the output must be; send one")
        field = given[0]
        if field == "structured_outputs":
            self.response_format = self.structured_outputs._format
        else:
            self.response_format = compiled_format(field.removeprefix("guided_"), getattr(self, field))
        return self

    @field_validator("n")
    @classmethod
    def _one_unless_said(cls, v):
        return 1 if v is None else v

    @property
    def choices_generated(self) -> int:
        """Choices the engines generate (best_of's, when more than n)."""
        return self.n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v):
        for key in v or {}:
            if not key.isdigit() or int(key) > UINT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {key!r}")
        return v

    def bias_pairs(self) -> dict[int, float]:
        return {int(k): b for k, b in (self.logit_bias or {}).items()}

    @property
    def grammar(self) -> str | None:
        """The grammar of `response_format` for the engines; None when the output is free text."""
        return self.response_format.compiled if self.response_format is not None else None

    def fenced_grammar(self, allow_fence: bool) -> str | None:
        """`grammar`, or with `allow_fence` and JSON asked for, the grammar that also allows the JSON in a
        markdown fence (the gateway takes the fence off: output/fence.py)."""
        fmt = self.response_format
        if allow_fence and fmt is not None and fmt.fenced and self.grammar == fmt.compiled:
            return fmt.fenced
        return self.grammar

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])


MAX_PROMPTS = 128  # prompts in one completions request (lm-evaluation-harness sends its batch as one)


class CompletionRequest(_Common):
    # text or token ids, or a list of either: several prompts (each with its n choices, indexed prompt-major);
    # a list of one (["text"], [[ids]]) is that prompt
    prompt: (NonEmptyText | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1,
                                                                                   max_length=MAX_PROMPTS)])
    echo: bool = Field(False, description=(  # before max_tokens: its validator reads it
        "the prompt comes back before the completion; with `logprobs`, its tokens' logprobs too (the first null)"))
    max_tokens: int | None = Field(16, ge=0, le=UINT32_MAX, description="0 only with `echo`: score the prompt")
    logprobs: TopLogprobs | None = Field(None, description=(
        "each token's logprob and the this many most likely tokens' (0..20), in `choices[i].logprobs`"))
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description=(
        "generate this many choices and return the n of highest cumulative logprob (not with stream)"))
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        """What the types below cannot say under `prompt` itself: an empty list or element, a mixed list."""
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
            kinds = {"text" if isinstance(e, str) else "ids" if isinstance(e, list) else "id" for e in v}
            if len(kinds) > 1:
                raise ValueError("prompt must be text, token ids, or a list of texts or of token-id lists, "
                                 "not a mix")
            for i, e in enumerate(v):
                if not isinstance(e, int) and not e:
                    raise ValueError(f"prompt {i} is empty")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and not isinstance(v[0], int) and len(v) == 1:
            v = v[0]
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @field_validator("max_tokens")
    @classmethod
    def _zero_tokens_only_to_echo(cls, v, info):
        if v == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens 0 is allowed only with echo")
        return v

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """Alternatives per prompt position the engines are asked for (echo with logprobs); None: none."""
        return self.logprobs if self.echo else None

    @property
    def top_logprobs_asked(self) -> int | None:
        """Alternatives per token the engines are asked for; None: no logprobs."""
        return self.logprobs

    @field_validator("best_of")
    @classmethod
    def _at_least_n(cls, v, info):
        if v is not None:
            if v < (info.data.get("n") or 1):
                raise ValueError("best_of must be at least n")
            if v > (info.data.get("n") or 1) and info.data.get("stream"):
                raise ValueError("best_of above n cannot be streamed: the best are known only at the end")
        return v

    @property
    def choices_generated(self) -> int:
        return max(self.n, self.best_of or 1)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise unsupported("suffix")
        return v


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = Field(None, description="each output token's logprob, in `choices[i].logprobs`")
    top_logprobs: TopLogprobs | None = Field(None, description=(
        "with `logprobs`: the this many most likely tokens at each position (0..20)"))
    tools: list[Tool] | None = Field(None, description=(
        "functions the model may call, rendered by the checkpoint's chat template (gateway/protocol/tools.py)"))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, description=(
        "`auto` (the default with tools), `none`, `required` or a named function: the last two make the output "
        "one call, enforced by a grammar"))
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's: how the chat template ends the prompt
    add_generation_prompt: bool = Field(True, description=(
        "extension (vLLM's): the template opens the assistant's turn after the messages"))
    continue_final_message: bool = Field(False, description=(
        "extension (vLLM's): the output continues the last message, an assistant's, as written (its turn is "
        "left open); needs add_generation_prompt false"))

    @model_validator(mode="after")
    def _continue_an_assistant(self):
        check_continue(self.messages, self.add_generation_prompt, self.continue_final_message)
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        """Alternatives per token the engines are asked for; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v, info):
        if v:
            raise unsupported(info.field_name, "(the deprecated form of tools) is not supported by this server; "
                               "send tools")
        return v

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, v, info):
        if v is not None and v != "none":
            raise unsupported(info.field_name, "(the deprecated form of tool_choice) is not supported by this "
                               "server; send tool_choice")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice, info):
        tools = info.data.get("tools")
        if choice not in (None, "none", "auto") and not tools:
            raise PydanticCustomError("invalid_value", "tool_choice other than none or auto needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise PydanticCustomError("invalid_value", "tool_choice names {name}, which is not in tools",
                                      {"name": choice.function.name})
        return choice

    _tool_grammar: str | None = PrivateAttr(None)  # tool_choice required or named: the call's grammar (app.py)

    @property
    def grammar(self) -> str | None:
        return self._tool_grammar or super().grammar

    @property
    def tools_offered(self) -> list[dict] | None:
        """The tools the prompt shows the model (none with tool_choice `none`), as chat templates take them."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def forced_function(self) -> str | None:
        """'' for tool_choice `required` (any tool), the name of a named one, None when the model may answer."""
        if self.tool_choice == "required":
            return ""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
