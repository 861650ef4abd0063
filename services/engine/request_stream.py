"""One request's stream as the engine loop (engine_loop.py) produces it and a handler reads it: its token
events, its timings, its reservation for a hybrid hand-off, its cancellation. The handler's side reads
(`events`, `wait_reserved`, `cancel`); the loop thread's side puts (`_emit`, `_fail`): the only hand-over
between the two threads is the stream's queue and its reserved event."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from services.engine.token_event import TokenEvent
from services.engine.logprobs import TokenLogprob
from services.engine.sampling import Sampler
from services.engine.sequence import Sequence
from services.errors import Cancelled

ExportHook = Callable[[int, tuple[int, ...], int], None]  # (layer, block_table, n_tokens)


class StreamOwner(Protocol):
    """What a stream asks of the loop that feeds it (the EngineLoop)."""

    def _post(self, item: tuple) -> None:
        """Hand the loop thread a request between steps (here: ("abort", stream))."""

    def _release(self, stream: "RequestStream") -> None:
        """Give back the loop's place the stream held."""


@dataclass
class StreamTimings:
    submitted_at: float
    scheduled_at: float | None = None  # its first chunk began (queue time ends)
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0
    draft_tokens: int = 0  # speculative decoding: drafts verified, and accepted
    accepted_draft_tokens: int = 0

    @property
    def queue_s(self) -> float:
        return (self.scheduled_at or self.submitted_at) - self.submitted_at

    @property
    def prefill_s(self) -> float:
        """First chunk scheduled → first token (the prompt's prefill, chunked or not)."""
        if self.first_token_at is None or self.scheduled_at is None:
            return 0.0
        return self.first_token_at - self.scheduled_at

    @property
    def decode_s(self) -> float:
        if self.first_token_at is None or self.last_token_at is None:
            return 0.0
        return self.last_token_at - self.first_token_at


@dataclass(eq=False)
class RequestStream:
    """One request's tokens as the loop produces them. Iterate for TokenEvents (the last one
    carries the finish_reason); `cancel()` drops the request from the next step."""

    loop: StreamOwner
    seq: Sequence
    sampler: Sampler
    export: ExportHook | None = None
    timings: StreamTimings = field(default_factory=lambda: StreamTimings(time.perf_counter()))
    _events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _reserved: threading.Event = field(default_factory=threading.Event)
    block_table: tuple[int, ...] = ()  # reserve_remote: the blocks to import into
    max_cached_tokens: int | None = None  # reserve_remote: take at most this much from the prefix cache
    done: bool = False
    _counted: bool = False  # holds one of the loop's places (EngineLoop._release gives it back)
    _prompt_logprobs: dict = field(default_factory=dict)  # prompt position → TokenLogprob (all_logits)

    def keep_prompt_logprobs(self, start: int, n: int, logprob_of: Callable[[int, int, int], TokenLogprob]) -> int:
        """The loop thread: n rows of positions start.. (each predicts the next position's token);
        logprob_of(row, token, k): that row's TokenLogprob of `token` with its k best. How many it kept."""
        seq, k = self.seq, self.seq.sampling_params.prompt_logprobs
        kept = 0
        for i in range(n):
            predicted = start + i + 1
            if predicted < seq.num_prompt_tokens:
                self._prompt_logprobs[predicted] = logprob_of(i, seq.token_ids[predicted], k)
                kept += 1
        return kept

    def prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """Positions 1..n-1 of the prompt, when the request asked for them."""
        if self.seq.sampling_params is None or self.seq.sampling_params.prompt_logprobs is None \
                or not self.seq.all_logits:
            return None
        return tuple(self._prompt_logprobs[p] for p in range(1, self.seq.num_prompt_tokens))

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    def cancel(self) -> None:
        if not self.done:
            self.loop._post(("abort", self))

    def events(self, poll_s: float = 0.05, cancelled: Callable[[], bool] = lambda: False) -> Iterator[TokenEvent]:
        """The token events; raises the loop's error, or Cancelled once `cancelled()` turns true
        (the stream is then dropped). Closing the iterator early cancels the request too."""
        try:
            while True:
                if cancelled():
                    raise Cancelled("cancelled")
                try:
                    kind, payload, reason = self._events.get(timeout=poll_s)
                except queue.Empty:
                    continue
                if kind == "error":
                    raise payload
                token, logprob, prompt_logprobs, at = payload
                # `more`: the next event is queued already, so a reader may take it before it sends this one
                yield TokenEvent(token, reason, logprob=logprob, prompt_logprobs=prompt_logprobs, at=at,
                                 more=not self._events.empty())
                if reason is not None:
                    return
        finally:
            if not self.done:
                self.cancel()

    def __iter__(self) -> Iterator[TokenEvent]:
        return self.events()

    def wait_reserved(self, cancelled: Callable[[], bool], poll_s: float = 0.05) -> tuple[int, ...]:
        """reserve_remote: block until the blocks are reserved; their table."""
        while not self._reserved.wait(poll_s):
            if cancelled():
                self.cancel()
                raise Cancelled("cancelled while waiting for KV blocks")
        if not self.block_table:  # failed or cancelled before it got blocks
            kind, payload, _ = self._events.get()
            raise payload if kind == "error" else Cancelled("cancelled")
        return self.block_table

    # ---- the loop thread's side --------------------------------------------------------
    def _emit(self, token: int, reason: str | None, logprob=None, prompt_logprobs=None, at: float = 0.0) -> None:
        self._events.put(("token", (token, logprob, prompt_logprobs, at), reason))

    def _fail(self, exc: Exception) -> None:
        self.loop._release(self)
        self.done = True
        self._reserved.set()
        self._events.put(("error", exc, None))
