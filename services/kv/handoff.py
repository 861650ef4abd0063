"""The KV hand-off seam between the two engines, one request at a time.

Which side calls what:
* prefill_gpu (sender): `KVSender.write_layer(l)` from the prefill's on_layer
  callback, then `wait_layer(l)` before announcing layer l (LayerReady).
* decode_fpga (receiver): `KVReceiver.accept_slot(msg)` on SlotGranted (checks the
  header), `import_layer(msg)` on each LayerReady (copies the layer into the
  device KV), `finish()` once PrefillDone arrives (waits until every layer is on
  the device). Only then may the slot be released.
"""
from __future__ import annotations

import enum
import time

import numpy as np

from services.kv.arena import Arena, ArenaReader, HeaderMismatch, Slot, SlotHeader
from services.kv.layout import WireLayout


class HandoffState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # waiting for a slot
    TRANSFERRING = "transferring"  # layers arriving
    SUCCESS = "success"  # every layer is on the receiving device
    FAILED = "failed"


class KVSender:
    """Writes one sequence's KV from the torch engine into its arena slot, layer by layer.

    On CUDA the device-to-host copy runs on a side stream into the pinned slot, so
    layer l travels while layer l+1 computes; on the CPU it is a memcpy.
    """

    def __init__(self, arena: Arena, slot: Slot, layout: WireLayout, engine, seq):
        import torch

        self.arena, self.slot, self.layout, self.engine, self.seq = arena, slot, layout, engine, seq
        self._dtype = torch.float16 if layout.dtype == np.float16 else torch.float32
        self._slot_bytes = arena.data_view(slot, layout.nbytes)
        self._cuda = getattr(engine, "device", None) is not None and engine.device.type == "cuda"
        self._stream = torch.cuda.Stream(engine.device) if self._cuda else None
        self._events: dict[int, object] = {}
        self.written_at: dict[int, float] = {}

    def write_layer(self, layer: int) -> None:
        import torch

        src = self.engine.export_kv_layer(self.seq, layer, self.layout.n_tokens).to(self._dtype)
        dst = torch.from_numpy(self.layout.layer_view(self._slot_bytes, layer))
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.engine.device))
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._events[layer] = event
        else:
            dst.copy_(src)
            self.written_at[layer] = time.time()

    def wait_layer(self, layer: int) -> float:
        """Block until layer `layer` is in the arena; the unix time it got there."""
        event = self._events.pop(layer, None)
        if event is not None:
            event.synchronize()
            self.written_at[layer] = time.time()
        return self.written_at[layer]


class KVReceiver:
    """Imports one request's KV from the arena into an engine's device KV cache."""

    def __init__(self, reader: ArenaReader, engine, seq, expected: SlotHeader):
        self.reader, self.engine, self.seq, self.expected = reader, engine, seq, expected
        self.state = HandoffState.BOOTSTRAPPING
        self.layout: WireLayout | None = None
        self._slot_offset = 0
        self.bytes = 0
        self.first_written_at: float | None = None
        self.on_device_at: float | None = None

    def accept_slot(self, offset: int, n_tokens: int, dtype: str) -> None:
        header = self.reader.read_header(offset)
        header.check_against(SlotHeader(**{**self.expected.__dict__, "n_tokens": n_tokens, "dtype": dtype}))
        e = self.expected
        self.layout = WireLayout(e.n_layers, e.n_kv_heads, e.head_dim, n_tokens, np.dtype(
            np.float16 if dtype == "fp16" else np.float32))
        self._slot_offset = offset
        self.state = HandoffState.TRANSFERRING

    def import_layer(self, layer: int, offset: int, nbytes: int, written_at: float) -> None:
        if self.state is not HandoffState.TRANSFERRING:
            raise HeaderMismatch(f"layer {layer} arrived before its slot was granted")
        lay = self.layout
        if nbytes != lay.layer_nbytes or offset != self._slot_offset + 64 + lay.layer_offset(layer):
            raise HeaderMismatch(f"layer {layer} at [{offset}, +{nbytes}) does not match the slot's layout")
        raw = self.reader.view(offset, nbytes)
        kv = np.frombuffer(raw, dtype=lay.dtype).reshape(lay.layer_shape)
        self.engine.import_kv_layer(self.seq, layer, kv)
        self.bytes += nbytes
        if self.first_written_at is None:
            self.first_written_at = written_at

    def finish(self) -> None:
        self.engine.finish_import(self.seq, self.layout.n_tokens)
        self.on_device_at = time.time()
        self.state = HandoffState.SUCCESS

    def consume(self, messages, keep_going=lambda: True):
        """Drive the hand-off from a Prefill response stream; the PrefillDone message once every
        layer is on the device, or None if `keep_going()` turned false first. The caller then
        ends the call, which frees the slot."""
        for msg in messages:
            kind = msg.WhichOneof("event")
            if kind == "slot":
                self.accept_slot(msg.slot.offset, msg.slot.n_tokens, msg.slot.dtype)
            elif kind == "layer":
                self.import_layer(msg.layer.layer, msg.layer.offset, msg.layer.nbytes, msg.layer.written_at)
            elif kind == "done":
                self.finish()
                return msg.done
            if not keep_going():
                break
        self.state = HandoffState.FAILED
        return None
