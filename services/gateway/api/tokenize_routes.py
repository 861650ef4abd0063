"""vLLM's /tokenize and /detokenize: the served model's tokenizer over HTTP, so a client can count a
prompt's tokens before it sends it (a chat's under the model's template, rendered as
/v1/chat/completions renders it) and turn token ids back into text.

    POST /tokenize    {"prompt": "..."} or {"messages": [...]}  -> {"count", "max_model_len", "tokens"}
    POST /detokenize  {"tokens": [ids]}                          -> {"prompt"}

The tokenizer runs on the gateway's tokenizer thread (`State.tokenize`), as the generation routes' does.
"""
from __future__ import annotations

from typing import Annotated, Callable

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from services.gateway.api import openapi
from services.gateway.protocol.chat_messages import ChatMessage, check_continue
from services.gateway.protocol.errors import APIError
from services.gateway.protocol.fields import Text, TokenId
from services.gateway.protocol.tools import template_messages
from services.model.tokenizer import ChatTemplateRefused, NoChatTemplate, chat_prompt_ids, ids_text, text_ids

MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize body: more than any context window


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = Field(None, description="the served model's name; any other is a 404")
    prompt: Text | None = Field(None, description="text, tokenized as /v1/completions tokenizes it")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(None, description=(
        "a chat, rendered by the model's chat template as /v1/chat/completions renders it"))
    add_special_tokens: bool = Field(True, description="with `prompt`: the tokenizer's own (a BOS, for some)")
    add_generation_prompt: bool = Field(True, description="with `messages`: the assistant's turn opened")
    continue_final_message: bool = Field(False, description=(
        "with `messages`: the last message, an assistant's, left open (needs add_generation_prompt false)"))

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_value", "send `prompt` or `messages`, one of them")
        if self.messages is not None:
            check_continue(self.messages, self.add_generation_prompt, self.continue_final_message)
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE)]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int = Field(description="the longest context an engine up now holds (0: none is up)")
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


async def chat_ids(st, messages: list[ChatMessage], tools: list[dict] | None = None,
                   add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """A chat's prompt ids under the model's chat template, on the tokenizer thread (`State.tokenize`), as
    /v1/chat/completions and /tokenize both render it; a checkpoint without a template, or a template that
    refuses the messages, is the request's 400 (param `messages`)."""
    try:
        return await st.tokenize(chat_prompt_ids, template_messages(messages), tools, add_generation_prompt,
                                 continue_final_message)
    except (NoChatTemplate, ChatTemplateRefused) as exc:
        raise APIError(400, str(exc), "messages", "invalid_value") from exc


def tokenize_routes(get_state: Callable[[], object], check_model: Callable[[object, str], None]) -> APIRouter:
    """The two routes, reading the gateway's State through `get_state` (app.py owns it)."""
    routes = APIRouter()
    documented = openapi.errors(400, 401, 404, 408, 413)

    def serving(model: str | None):
        """The gateway's State; a 404 when the body names another model than the one served."""
        st = get_state()
        if model is not None:
            check_model(st, model)
        return st

    @routes.post("/tokenize", response_model=TokenizeResponse, responses=documented)
    async def tokenize(body: TokenizeRequest):
        st = serving(body.model)
        if body.prompt is not None:
            ids = await st.tokenize(text_ids, body.prompt, body.add_special_tokens)
        else:
            ids = await chat_ids(st, body.messages, None, body.add_generation_prompt, body.continue_final_message)
        out = TokenizeResponse(count=len(ids), max_model_len=st.dispatcher.context_window(), tokens=ids)
        return Response(out.model_dump_json(), media_type="application/json")

    @routes.post("/detokenize", response_model=DetokenizeResponse, responses=documented)
    async def detokenize(body: DetokenizeRequest):
        st = serving(body.model)
        vocab = len(st.tokenizer)
        beyond = sorted({t for t in body.tokens if t >= vocab})
        if beyond:
            raise APIError(400, f"token ids must be below the vocabulary size {vocab}: {beyond[:5]}", "tokens",
                           "invalid_value")
        text = await st.tokenize(ids_text, body.tokens)
        return Response(DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")

    return routes
