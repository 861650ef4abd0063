"""The shared-memory hand-off transport: one arena slot per request (arena.py), same host only.

The grant's offset is the slot header's offset in the arena; a layer's offset is
where its bytes start in the arena, right after the header and the layers before it.
"""
from __future__ import annotations

import numpy as np

from services.kv.arena import Arena, ArenaReader, Slot
from services.kv.handoff import KVReceiver, KVSender, LayerReady, SlotGrant
from services.kv.header import HEADER_SIZE, HeaderMismatch, SlotHeader


class ShmSender(KVSender):
    """prefill_gpu's side: allocates the slot (waiting up to `wait_s`, else ArenaFull) and frees it."""

    def __init__(self, arena: Arena, header: SlotHeader, wait_s: float):
        super().__init__(header)
        self.arena, self.wait_s = arena, wait_s
        self.slot: Slot | None = None
        self._bytes: np.ndarray | None = None

    def _open(self) -> SlotGrant:
        self.slot = self.arena.allocate(self.layout.nbytes, timeout=self.wait_s)
        self.arena.write_header(self.slot, self.header)
        self._bytes = self.arena.data_view(self.slot, self.layout.nbytes)
        return SlotGrant(self.slot.offset, self.slot.size, self.header.n_tokens, self.header.dtype)

    def _data(self) -> np.ndarray:
        return self._bytes

    def _layer_location(self, layer: int) -> int:
        return self.slot.data_offset + self.layout.layer_offset(layer)

    def _close(self) -> None:
        if self.slot is not None:
            self.arena.free(self.slot)  # idempotent


class ShmReceiver(KVReceiver):
    """decode_fpga's side: reads the slot through its read-only mapping of the arena."""

    def __init__(self, reader: ArenaReader, engine, seq, expected: SlotHeader):
        super().__init__(engine, seq, expected)
        self.reader = reader

    def _read_header(self, grant: SlotGrant) -> SlotHeader:
        return self.reader.read_header(grant.offset)

    def _layer_bytes(self, msg: LayerReady) -> memoryview:
        where = self.grant.offset + HEADER_SIZE + self.layout.layer_offset(msg.layer)
        if msg.offset != where:
            raise HeaderMismatch(f"layer {msg.layer} at offset {msg.offset} is not where the slot's layout "
                                 f"puts it ({where})")
        return self.reader.view(msg.offset, msg.nbytes)
