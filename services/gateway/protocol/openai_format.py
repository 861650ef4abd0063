"""What the gateway answers, as pydantic models: OpenAI's completion and chat completion objects,
their stream chunks, usage, the model list, the error body, and our `hybridserve` extension.
(At 300 lines on purpose: every byte the API answers is described in this one file.)

Every byte of JSON a client gets is one of these models' `model_dump_json()`; no route builds a
dict by hand. Field order follows OpenAI's documents, so the JSON reads like theirs.

Streams (server-sent events), one request:

    chat:        role chunk, text chunks, finish chunk (+ hybridserve), [usage chunk], [DONE]
    completion:  text chunks, finish chunk (+ hybridserve), [usage chunk], [DONE]

With n > 1 each chunk names its choice (`index`): a role chunk per choice, their text chunks as
they come, then a finish chunk per choice, the last one with `hybridserve`.

An absent `usage` or `hybridserve` on a chunk is left out of the JSON, not sent as null;
`finish_reason` and `logprobs` are always there (null until the end), as OpenAI sends them.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field, model_serializer


class _LeavesOutNone(BaseModel):
    """Drops the fields named in `_omit_if_none` from the JSON while they are None."""

    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _leave_out_none(self, handler):
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


# ---- parts --------------------------------------------------------------------------------
class CompletionTokensDetails(BaseModel):
    """OpenAI's names for what speculation did: drafted tokens the model accepted, and those it did not."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(_LeavesOutNone):
    _omit_if_none = ("completion_tokens_details",)

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None  # only when the engine speculated

    @classmethod
    def of(cls, n_in: int, n_out: int, drafted: int = 0, accepted: int = 0) -> "Usage":
        details = CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                          rejected_prediction_tokens=drafted - accepted) if drafted else None
        return cls(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out,
                   completion_tokens_details=details)


class Timings(BaseModel):
    """Where the request's time went, in seconds (bytes for the hand-off); engine-measured but e2e_s."""

    queue_s: float
    prefill_s: float
    handoff_total_s: float
    handoff_exposed_s: float
    decode_s: float
    decode_tokens: int  # tokens after the first (the first comes out of prefill)
    handoff_bytes: int
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache
    draft_tokens: int = 0  # speculative decoding: draft tokens verified, and accepted
    accepted_draft_tokens: int = 0
    e2e_s: float  # as the gateway saw it


class MigrationRecord(BaseModel):
    """The request's engine was lost after `after_tokens` tokens; the rest ran in `to_mode`."""

    from_mode: str
    to_mode: str
    after_tokens: int
    from_pair: int = 0  # the engine pairs (their index) it ran on before and after
    to_pair: int = 0


class Hybridserve(_LeavesOutNone):
    """The `hybridserve` object on a response: which mode served it, why, and what it cost."""

    _omit_if_none = ("migrations", "placement", "prompts")

    mode: str  # the router's choice; where the request ended up after a migration: `migrations`
    reason: str  # "auto" | "forced" | "fallback"
    estimates: dict[str, float]  # the router's seconds per mode it considered
    timings: Timings  # the engine's timings of the last call (after a migration: of its part only)
    migrations: list[MigrationRecord] | None = None  # only on a request that migrated
    # with several pairs: the pair, what decided it (prefix | load | balance) and the prompt tokens it
    # held cached by the gateway's index (services/gateway/fleet/prefix_routing.py)
    placement: dict | None = None
    # a completions request with several prompts: each prompt's own (the fields above are the first's)
    prompts: list["Hybridserve"] | None = None


class CompletionLogprobs(BaseModel):
    """A completion choice's `logprobs` (logprobs_format.py fills it in); an echoed prompt's first
    token has null in `token_logprobs` and `top_logprobs`."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


# ---- unary responses ------------------------------------------------------------------
class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    hybridserve: Hybridserve


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI gives it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_LeavesOutNone):
    _omit_if_none = ("tool_calls",)

    role: Literal["assistant"] = "assistant"
    content: str | None  # None only beside tool_calls
    tool_calls: list[ToolCall] | None = None  # the model's calls of the request's tools (tools.py)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    hybridserve: Hybridserve


# ---- stream chunks --------------------------------------------------------------------
class CompletionChunk(_LeavesOutNone):
    _omit_if_none = ("usage", "hybridserve")

    id: str
    object: Literal["text_completion"] = "text_completion"  # OpenAI streams completions under this name too
    created: int
    model: str
    choices: list[CompletionChoice]  # empty on the usage chunk
    usage: Usage | None = None
    hybridserve: Hybridserve | None = None


class ToolCallDelta(ToolCall):
    index: int  # of the call in the message (a stream sends each call whole, in one chunk)


class Delta(_LeavesOutNone):
    _omit_if_none = ("role", "content", "tool_calls")

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_LeavesOutNone):
    _omit_if_none = ("usage", "hybridserve")

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]  # empty on the usage chunk
    usage: Usage | None = None
    hybridserve: Hybridserve | None = None


class ChunkWriter:
    """The chunks of one stream: same id, creation time and model on each; chat or completion shape."""

    def __init__(self, request_id: str, model: str, created: int, chat: bool):
        self.chat = chat
        self._head = {"id": request_id, "created": created, "model": model}

    def role(self, index: int = 0) -> ChatCompletionChunk:
        """Chat streams open with the assistant's role and no text (one such chunk per choice)."""
        choice = ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))
        return ChatCompletionChunk(**self._head, choices=[choice])

    def text(self, text: str, logprobs: CompletionLogprobs | ChatLogprobs | None = None, index: int = 0
             ) -> ChatCompletionChunk | CompletionChunk:
        """New text of choice `index` and, when asked for, the logprobs of the tokens that came with it."""
        if self.chat:
            choice = ChatChunkChoice(index=index, delta=Delta(content=text), logprobs=logprobs)
            return ChatCompletionChunk(**self._head, choices=[choice])
        return CompletionChunk(**self._head, choices=[CompletionChoice(index=index, text=text, finish_reason=None,
                                                                       logprobs=logprobs)])

    def tool_calls(self, calls: list[ToolCall], index: int = 0) -> ChatCompletionChunk:
        """A chat choice's calls, each whole (a stream with tools holds the text until the calls are known)."""
        deltas = [ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(calls)]
        return ChatCompletionChunk(**self._head, choices=[ChatChunkChoice(index=index, delta=Delta(tool_calls=deltas))])

    def finish(self, finish_reason: str, extension: Hybridserve | None, index: int = 0
               ) -> ChatCompletionChunk | CompletionChunk:
        """A choice's last chunk: no new text, its finish reason; the `hybridserve` object on the last one."""
        if self.chat:
            choice = ChatChunkChoice(index=index, delta=Delta(), finish_reason=finish_reason)
            return ChatCompletionChunk(**self._head, choices=[choice], hybridserve=extension)
        return CompletionChunk(**self._head, choices=[CompletionChoice(index=index, text="",
                                                                       finish_reason=finish_reason)],
                               hybridserve=extension)

    def usage(self, usage: Usage) -> ChatCompletionChunk | CompletionChunk:
        """Sent after the finish chunk when the request asked for `stream_options.include_usage`."""
        return (ChatCompletionChunk if self.chat else CompletionChunk)(**self._head, choices=[], usage=usage)


def sse(event: BaseModel) -> str:
    """One server-sent event carrying a model's JSON."""
    return f"data: {event.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ---- other bodies ---------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "hybridserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """`/health` (and `/readyz`), the readiness signal: 200 only once the stack serves at its speed (some
    pair has both engines up, and the router has been calibrated once: the engines' profiles are in and
    a check of an unquiet one is over); else a 503 whose `waiting_for` says what it waits on. `status`:
    "starting" until the first time it was ready, then "ok" when every engine answers, "degraded" when
    one does not (still a 200 while some pair has both engines up: the gateway serves every mode), and
    "draining" (a 503) once the gateway is shutting down. With several pairs, an engine's key is
    "<engine>@<pair>". `calibrated`: the router's calibration right now (a re-check after an engine
    restart makes it false again without taking readiness away: the check yields to requests)."""

    status: Literal["starting", "ok", "degraded", "draining"]
    ready: bool = False
    waiting_for: list[str] = Field(default_factory=list, description=(
        "what readiness waits on: engines by name, `calibration`, or `drain` (the gateway is stopping)"))
    engines: dict[str, Literal["up", "down"]]
    calibrated: bool = False


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """`{"error": {...}}`: every error, unary or in a stream (errors.py fills it in)."""

    error: ErrorDetail
