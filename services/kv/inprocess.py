"""The in-process hand-off transport: both sides in one process, the KV in plain memory.

For tests (the whole hybrid path without shared memory or a second process) and
as the shape a network transport follows: a link both sides hold, a buffer per
granted request, the same header and checks as the shared-memory transport.
The grant's offset is the request's key in the link; a layer's offset is where
its bytes start in that request's buffer.
"""
from __future__ import annotations

import itertools
import threading

import numpy as np

from services.kv.handoff import KVReceiver, KVSender, LayerReady, SlotGrant
from services.kv.header import HeaderMismatch, SlotHeader


class InProcessLink:
    """The memory both sides share: one (header, buffer) per granted request, until the sender closes."""

    def __init__(self):
        self._slots: dict[int, tuple[SlotHeader, np.ndarray]] = {}
        self._keys = itertools.count(1)
        self._lock = threading.Lock()

    def put(self, header: SlotHeader, nbytes: int) -> int:
        with self._lock:
            key = next(self._keys)
            self._slots[key] = (header, np.zeros(nbytes, np.uint8))
            return key

    def get(self, key: int) -> tuple[SlotHeader, np.ndarray]:
        with self._lock:
            if key not in self._slots:
                raise HeaderMismatch(f"no request {key} in this link (never granted, or already freed)")
            return self._slots[key]

    def free(self, key: int) -> None:
        with self._lock:
            self._slots.pop(key, None)

    @property
    def slots_in_use(self) -> int:
        return len(self._slots)


class InProcessSender(KVSender):
    def __init__(self, link: InProcessLink, header: SlotHeader):
        super().__init__(header)
        self.link = link
        self.key: int | None = None

    def _open(self) -> SlotGrant:
        self.key = self.link.put(self.header, self.layout.nbytes)
        return SlotGrant(self.key, self.layout.nbytes, self.header.n_tokens, self.header.dtype)

    def _data(self) -> np.ndarray:
        return self.link.get(self.key)[1]

    def _layer_location(self, layer: int) -> int:
        return self.layout.layer_offset(layer)

    def _close(self) -> None:
        if self.key is not None:
            self.link.free(self.key)


class InProcessReceiver(KVReceiver):
    def __init__(self, link: InProcessLink, engine, seq, expected: SlotHeader):
        super().__init__(engine, seq, expected)
        self.link = link

    def _read_header(self, grant: SlotGrant) -> SlotHeader:
        return self.link.get(grant.offset)[0]

    def _layer_bytes(self, msg: LayerReady) -> np.ndarray:
        where = self.layout.layer_offset(msg.layer)
        if msg.offset != where:
            raise HeaderMismatch(f"layer {msg.layer} at offset {msg.offset} is not where the layout puts it ({where})")
        return self.link.get(self.grant.offset)[1][where: where + msg.nbytes]
