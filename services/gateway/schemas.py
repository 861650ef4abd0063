"""Request bodies of the OpenAI-compatible API (what we accept, validated)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.modes import AUTO, MODE_NAMES

ModeName = Literal[(AUTO, *MODE_NAMES)]  # "auto", "gpu", "fpga", "hybrid": services/modes.py is the list


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    # unknown fields are ignored, as OpenAI-compatible servers do; unsupported values of known ones are refused
    model_config = ConfigDict(extra="ignore")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None
    mode: ModeName = AUTO  # extension: force a mode
    ignore_eos: bool = False  # extension, for benchmarks
    timeout: float | None = Field(None, gt=0)  # extension: seconds before 504

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])


class CompletionRequest(_Common):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if (isinstance(v, str) and not v) or (isinstance(v, list) and not v):
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
