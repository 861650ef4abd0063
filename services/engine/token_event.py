"""What an engine hands back for each token it generates: `TokenEvent`, read by the servicer, the
hybrid hand-off, the command line's `generate` and tests."""
from __future__ import annotations

from dataclasses import dataclass

from services.engine.logprobs import TokenLogprob
from services.engine.requests import RequestTimings


@dataclass(frozen=True)
class TokenEvent:
    token: int
    finish_reason: str | None  # set on the last token only
    timings: RequestTimings | None = None  # the runtime sets it on the last token only
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # on the first token, when asked for
    index: int = 0  # the choice (a request with n > 1)
    at: float = 0.0  # time.perf_counter() when the engine loop's step that made it ended (token_trace.py)
    # another event was already waiting behind this one when it was read: the servicer may put both in
    # one message instead of sending this one alone (a hint: the next read does not block)
    more: bool = False
