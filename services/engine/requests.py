"""A request to an engine as plain Python: what comes in, how it is cancelled, what it reports.

The engine runtime (runtime.py) takes an `EngineRequest` and a `Cancellation` and
yields token events; it knows nothing of gRPC. The servicers (service.py) build
these from protos and turn the typed errors (services/errors.py) into statuses
(status.py).
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from services.engine.sampling import SamplingParams
from services.errors import InvalidRequest, PromptTooLong


@dataclass(frozen=True)
class EngineRequest:
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    mode: str  # a services.modes name: "gpu" | "fpga" | "hybrid"
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    prefill_address: str = ""  # hybrid mode: which prefill engine hands the KV over ("": the default one)


@dataclass
class RequestTimings:
    """What a finished request reports (the Timings message, field for field)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    handoff_total_s: float = 0.0  # first layer written → last layer on the device (hybrid only)
    handoff_exposed_s: float = 0.0  # end of prefill compute → last layer on the device (hybrid only)
    decode_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    handoff_bytes: int = 0
    cached_tokens: int = 0  # prompt positions from the prefix cache: prefill_s covers only the rest
    draft_tokens: int = 0  # speculative decoding: drafts verified for the request
    accepted_draft_tokens: int = 0  # ...and accepted


class Cancellation:
    """A request's cancellation token. Whoever stops the request calls `cancel()` (the servicer
    when the call ends, a test, shutdown); the work polls `is_cancelled()`, waits on it, or
    registers a callback. `deadline` (time.monotonic) bounds waits that have no other end."""

    def __init__(self, deadline: float | None = None):
        self.deadline = deadline
        self._event = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def cancel(self) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def is_cancelled(self) -> bool:
        return self._event.is_set()

    def add_callback(self, fn: Callable[[], None]) -> None:
        """Call `fn` once on cancellation; now if it already happened."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled, `timeout` s, or the deadline, whichever is first; True if cancelled."""
        if self.deadline is not None:
            left = max(0.0, self.deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        return self._event.wait(timeout)


def check_prompt(prompt_ids, vocab_size: int, max_context: int) -> None:
    """InvalidRequest / PromptTooLong unless the prompt has 1 to max_context - 1 ids, all in the vocabulary."""
    if not prompt_ids:
        raise InvalidRequest("the prompt must contain at least one token")
    if len(prompt_ids) >= max_context:
        raise PromptTooLong(f"prompt of {len(prompt_ids)} tokens leaves no room in the {max_context}-token context")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")
