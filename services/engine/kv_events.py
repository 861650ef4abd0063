"""What an engine's prefix cache holds, as numbered events a router can follow.

The block manager reports each block hash it registers (stored) and each it forgets (evicted,
or reset); the log numbers them. A reader (the gateway, through Info) asks for the events after
the last number it saw, under the log's epoch (a random id per engine start). The log keeps the
newest `capacity` events; a reader that fell further behind, a new one, or one that knew another
epoch (the engine restarted) gets a snapshot of every hash cached now instead. Answers are bounded
(`max_hashes`): a snapshot past that sends the newest hashes and says it is partial.

Thread-safe: the engine loop writes, gRPC handlers read. This is how a KV-aware router learns
where a prompt's prefix already is (NVIDIA Dynamo publishes the same "stored"/"removed" events),
without asking every engine about every prompt.
"""
from __future__ import annotations

import secrets
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

DEFAULT_CAPACITY = 8192
DEFAULT_MAX_HASHES = 8192


@dataclass
class KVDelta:
    """One answer: the cursor to ask with next time and what changed since the reader's cursor."""

    epoch: str
    seq: int
    snapshot: bool  # `stored` is everything cached now: drop what you had
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    partial: bool = False  # a snapshot cut at max_hashes


class KVEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_hashes: int = DEFAULT_MAX_HASHES):
        self.epoch = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._events: deque[tuple[int, bool, bytes]] = deque(maxlen=capacity)  # (seq, stored?, hash)
        self._cached: OrderedDict[bytes, None] = OrderedDict()  # what a snapshot sends, oldest first
        self._seq = 0
        self.max_hashes = max_hashes

    def stored(self, key: bytes) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, True, key))
            self._cached[key] = None

    def removed(self, key: bytes) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, False, key))
            self._cached.pop(key, None)

    def since(self, epoch: str, seq: int) -> KVDelta:
        """What a reader whose cursor is (epoch, seq) has not seen."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            if epoch != self.epoch or seq > self._seq or seq + 1 < oldest or self._seq - seq > self.max_hashes:
                hashes = list(self._cached)
                return KVDelta(self.epoch, self._seq, True, hashes[-self.max_hashes:],
                               partial=len(hashes) > self.max_hashes)
            delta = KVDelta(self.epoch, self._seq, False)
            for s, is_stored, key in self._events:
                if s > seq:
                    (delta.stored if is_stored else delta.removed).append(key)
            return delta
