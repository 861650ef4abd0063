"""prefill_gpu's admission of hybrid hand-offs, sized from the memory they hold, not a fixed count.

A hand-off holds its KV in the transport's memory from its SlotGrant until the reader ends the
call: an arena slot (shm; the reader may first wait for its own KV blocks), or a buffer of this
process (TCP, in-process). That memory is what bounds how many can be in flight. A fixed count
(8 until now) was the wrong bound both ways: at 32 clients prefills queued behind it (hybrid's
TTFT p50 was 15 s) while the arena had room for many more short prompts, and a few long prompts
could still find the arena full and be refused after a short wait.

So a hand-off is admitted when its memory can be reserved now, first come first served: the
head of the queue asks its sender to reserve (`KVSender.reserve_now`: a free arena slot of the
request's size, first fit), and it is admitted when that succeeds and its bytes fit the budget
(`capacity`: the arena's size; for transports with their own buffers the same number of bytes
bounds them). Otherwise it waits, and is woken when an admitted hand-off lets go. FIFO, so a
long prompt at the head is never overtaken and starved by short ones behind it. The wait ends
in admission, the client going away (Cancelled), the call's deadline (HandoffTimedOut), or at
once: more than `queue_depth` waiting (QueueFull, back-pressure: 429) or a hand-off larger than
the whole budget (HandoffTooLarge: it could never fit, so a retry would not help).

`max_running` caps the count as well: an explicit HYBRIDSERVE_PREFILL_HANDOFF_MAX_CONCURRENCY,
or with `auto` (the default) the engine loop's max_num_seqs (more prompts than one batch holds
would only wait inside the loop with their memory held, and every hand-off in flight holds a
server thread, which must be a bounded number).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Callable, Iterator

from services.engine import metrics as m
from services.engine.requests import Cancellation
from services.errors import Cancelled, HandoffTimedOut, HandoffTooLarge, QueueFull

POLL_S = 0.05  # how often a waiter checks its cancellation: a client gone must leave the queue soon


class HandoffAdmission:
    def __init__(self, capacity: int, max_running: int, queue_depth: int):
        self.capacity, self.max_running, self.queue_depth = capacity, max_running, queue_depth
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()  # waiting tickets, oldest first
        self.running = 0  # hand-offs admitted and not yet let go
        self.bytes_held = 0  # their memory

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @contextlib.contextmanager
    def admit(self, nbytes: int, reserve: Callable[[], bool], cancel: Cancellation) -> Iterator[float]:
        """Hold `nbytes` of the budget (and whatever `reserve()` took) for the block; yields the seconds
        spent waiting. `reserve()` is asked only at the head of the queue, under the admission's lock:
        True once the transport's memory is reserved (what it reserved is its caller's to free)."""
        if nbytes > self.capacity:
            raise HandoffTooLarge(f"the prompt's KV for the hand-off ({nbytes / 2**20:.1f} MiB) can never fit the "
                                  f"{self.capacity / 2**20:.1f} MiB hand-off memory "
                                  f"(HYBRIDSERVE_PREFILL_ARENA_BYTES): serve it in gpu or fpga mode, or raise that")
        start = time.perf_counter()
        with self._cond:
            if self._queue or not self._try_admit(nbytes, reserve):
                self._wait(nbytes, reserve, cancel)
        try:
            yield time.perf_counter() - start
        finally:
            with self._cond:
                self.running -= 1
                self.bytes_held -= nbytes
                self._publish()
                self._cond.notify_all()

    def _try_admit(self, nbytes: int, reserve: Callable[[], bool]) -> bool:
        if self.running >= self.max_running or self.bytes_held + nbytes > self.capacity or not reserve():
            return False
        self.running += 1
        self.bytes_held += nbytes
        self._publish()
        return True

    def _publish(self) -> None:
        m.HANDOFFS_ADMITTED.set(self.running)
        m.HANDOFF_BYTES_HELD.set(self.bytes_held)

    def _wait(self, nbytes: int, reserve: Callable[[], bool], cancel: Cancellation) -> None:
        """Queue (holding the lock between waits) until admitted at the head; raises if not."""
        if len(self._queue) >= self.queue_depth:
            raise QueueFull(f"hand-off queue full ({len(self._queue)} waiting for KV memory); retry later")
        ticket = object()
        self._queue.append(ticket)
        m.QUEUE_DEPTH.set(len(self._queue))
        try:
            while not (self._queue[0] is ticket and self._try_admit(nbytes, reserve)):
                if cancel.is_cancelled():
                    raise Cancelled("cancelled while waiting for hand-off memory")
                if cancel.deadline is not None and time.monotonic() >= cancel.deadline:
                    raise HandoffTimedOut("the hand-off's deadline passed while it waited for KV memory")
                self._cond.wait(POLL_S)
        finally:
            self._queue.remove(ticket)
            m.QUEUE_DEPTH.set(len(self._queue))
            self._cond.notify_all()  # the next in line may fit too (or is the head now)
