"""The shared-memory hand-off transport: one arena slot per request (arena.py), same host only.

The grant's offset is the slot header's offset in the arena; a layer's offset is
where its bytes start in the arena, right after the header and the layers before it.

The receiver maps the arena by the name prefill_gpu gives; after a prefill_gpu
restart that name is another. `remap` (from whoever knows the name: the decode
service's peer) gives the arena to read now: the receiver asks for it when the
granted slot does not carry its request's nonce in the arena it has mapped, so
the first request after a restart reads the new arena, never the old one's KV.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from services.kv.arena import Arena, ArenaReader, Slot
from services.kv.handoff import KVReceiver, KVSender, LayerReady, SlotGrant
from services.kv.header import HEADER_SIZE, HeaderMismatch, SlotHeader


class ShmSender(KVSender):
    """prefill_gpu's side: allocates the slot (`reserve_now`, or in `open` waiting up to `wait_s`, else
    ArenaFull) and frees it."""

    def __init__(self, arena: Arena, header: SlotHeader, wait_s: float = 0.0):
        super().__init__(header)
        self.arena, self.wait_s = arena, wait_s
        self.slot: Slot | None = None
        self._bytes: np.ndarray | None = None

    @property
    def memory_bytes(self) -> int:
        return self.arena.slot_size(self.layout.nbytes)

    def reserve_now(self) -> bool:
        if self.slot is None:
            self.slot = self.arena.try_allocate(self.layout.nbytes)
        return self.slot is not None

    def _open(self) -> SlotGrant:
        if self.slot is None:  # not reserved ahead by an admission: wait for one here, bounded
            self.slot = self.arena.allocate(self.layout.nbytes, timeout=self.wait_s)
        self.header = self.arena.write_header(self.slot, self.header)  # now with the slot's generation
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
    """decode_fpga's side: reads the slot through its mapping of the arena; `remap(reader)` returns the
    arena prefill_gpu uses now (the same reader when it has not changed)."""

    def __init__(self, reader: ArenaReader, engine, seq, expected: SlotHeader,
                 remap: Callable[[ArenaReader], ArenaReader] | None = None):
        super().__init__(engine, seq, expected)
        self.reader, self._remap = reader, remap

    def accept(self, grant: SlotGrant) -> None:
        if self._remap is not None and not self._carries_our_nonce(grant):
            self.reader = self._remap(self.reader)  # prefill_gpu may have restarted with a new arena
        super().accept(grant)

    def _carries_our_nonce(self, grant: SlotGrant) -> bool:
        nonce = self.expected.nonce or grant.nonce
        try:
            return self.reader.is_current() and (not nonce or self.reader.read_header(grant.offset).nonce == nonce)
        except HeaderMismatch:
            return False

    def _read_header(self, grant: SlotGrant) -> SlotHeader:
        return self.reader.read_header(grant.offset)

    def _layer_bytes(self, msg: LayerReady) -> memoryview:
        where = self.grant.offset + HEADER_SIZE + self.layout.layer_offset(msg.layer)
        if msg.offset != where:
            raise HeaderMismatch(f"layer {msg.layer} at offset {msg.offset} is not where the slot's layout "
                                 f"puts it ({where})")
        return self.reader.view(msg.offset, msg.nbytes)
