"""The token loop any engine runs for one request: prefill, then decode until a finish.

Yields each generated token as soon as it exists, and keeps the stage timings
(`prefill_s` covers the first token; `decode_s` the `decode_tokens` after it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from services.engine.api import Engine
from services.engine.request_state import RequestState, finish_reason, state_after_token
from services.errors import InvalidRequest, PromptTooLong
from services.engine.sampling import Sampler, SamplingParams
from services.engine.token_event import TokenEvent

__all__ = ["Generation", "PromptTooLong", "TokenEvent", "Timings"]


@dataclass
class Timings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0


@dataclass
class Generation:
    """Iterate to run it. `timings` and `state` are final once iteration ends."""

    engine: Engine
    prompt_ids: list[int]
    params: SamplingParams
    max_context: int
    timings: Timings = field(default_factory=Timings)
    state: RequestState = RequestState.WAITING

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise InvalidRequest("the prompt must contain at least one token")
        if len(self.prompt_ids) >= self.max_context:
            raise PromptTooLong(
                f"prompt of {len(self.prompt_ids)} tokens leaves no room in the {self.max_context}-token context"
            )
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in self.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}")

    def __iter__(self) -> Iterator[TokenEvent]:
        p = self.params
        capacity = min(len(self.prompt_ids) + p.max_tokens, self.max_context)
        sampler = Sampler(p)
        seq = self.engine.new_sequence(capacity)
        try:
            self.state = RequestState.PREFILLING
            t0 = time.perf_counter()
            try:
                token = sampler.sample(self.engine.prefill(seq, self.prompt_ids), position=len(self.prompt_ids))
            except Exception:
                self.state = RequestState.FINISHED_ERROR
                raise
            self.timings.prefill_s = time.perf_counter() - t0
            yield from self.decode_from(seq, token, sampler)
        finally:
            self.engine.release(seq)

    def decode_from(self, seq, first_token: int, sampler: Sampler) -> Iterator[TokenEvent]:
        """Emit `first_token`, then decode until a finish. `seq` holds the prompt's KV
        (prefilled here, or imported from another engine in hybrid mode); the caller
        releases it."""
        p = self.params
        eos = () if p.ignore_eos else self.engine.cfg.eos_token_ids
        stop_ids = frozenset(eos) | frozenset(p.stop_token_ids)
        room = min(len(self.prompt_ids) + p.max_tokens, self.max_context) - len(self.prompt_ids)
        token, n = first_token, 1
        t0 = time.perf_counter()
        try:
            while True:
                self.state = state_after_token(token, n, p.max_tokens, stop_ids, room - n)
                if self.state.finished:
                    self.timings.decode_s = time.perf_counter() - t0
                    self.timings.decode_tokens = n - 1
                    yield TokenEvent(token, finish_reason(self.state))
                    return
                yield TokenEvent(token, None)
                self.state = RequestState.DECODING
                if p.greedy:
                    token = self.engine.decode_greedy([seq], [token])[0]
                else:
                    token = sampler.sample(self.engine.decode([seq], [token])[0], position=len(self.prompt_ids) + n)
                n += 1
        except GeneratorExit:
            self.state = RequestState.FINISHED_ABORTED
            raise
        except Exception:
            self.state = RequestState.FINISHED_ERROR
            raise
