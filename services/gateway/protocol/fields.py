"""The field types the request bodies share: text that must be valid Unicode, numbers bounded by what the
engines' wire holds (uint32 token counts and top_k, a uint64 seed), the mode's name, and the 400 that
names a known field this stack cannot honour."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from services.engine.logprobs import MAX_TOP_LOGPROBS
from services.modes import AUTO, MODE_NAMES

ModeName = Literal[(AUTO, *MODE_NAMES)]  # "auto", "gpu", "fpga", "hybrid": services/modes.py is the list

UINT32_MAX = (1 << 32) - 1  # max_tokens, top_k and token ids are uint32 on the wire
UINT64_MAX = (1 << 64) - 1  # the seed is uint64


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("invalid_text", "text must be valid Unicode; it holds a lone surrogate") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
TokenCount = Annotated[int, Field(ge=1, le=UINT32_MAX)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]  # alternatives per position


def unsupported(field: str, what: str = "is not supported by this server") -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", "{field} {what}", {"field": field, "what": what})
