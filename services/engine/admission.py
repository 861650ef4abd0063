"""Admission: at most `max_running` requests run at once, at most `queue_depth` wait for them.

Beyond the queue a request is refused at once (QueueFull: back-pressure the gateway
turns into 429); a waiting request whose client goes away leaves the queue.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from services.engine import metrics as m
from services.engine.requests import Cancellation, Cancelled, QueueFull


class Admission:
    def __init__(self, max_running: int, queue_depth: int):
        self._sem = threading.Semaphore(max_running)
        self._depth = queue_depth
        self._waiting = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def admit(self, cancel: Cancellation) -> Iterator[float]:
        """Hold a running place for the block; yields the seconds spent waiting for it."""
        start = time.perf_counter()
        if not self._sem.acquire(blocking=False):
            with self._lock:
                if self._waiting >= self._depth:
                    raise QueueFull(f"engine queue full ({self._depth} waiting); retry later")
                self._waiting += 1
                m.QUEUE_DEPTH.set(self._waiting)
            try:
                while not self._sem.acquire(timeout=0.05):
                    if cancel.is_cancelled():
                        raise Cancelled("cancelled while queued")
            finally:
                with self._lock:
                    self._waiting -= 1
                    m.QUEUE_DEPTH.set(self._waiting)
        try:
            yield time.perf_counter() - start
        finally:
            self._sem.release()
