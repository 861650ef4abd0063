"""Copies the torch engine's KV, layer by layer, into a hand-off sender's buffers.

On CUDA the device-to-host copy runs on a side stream into the (pinned) buffer,
so layer l travels while layer l+1 computes; on the CPU it is a memcpy. The
conversion to the wire dtype happens on the engine's device, before the copy.
"""
from __future__ import annotations

import time

import torch

from services.kv.handoff import KVSender, LayerReady


class LayerExporter:
    """Copies layers of one prompt's KV, read from the engine's pool through its block table."""

    def __init__(self, engine, sender: KVSender, skip_tokens: int = 0):
        self.engine, self.sender, self.skip = engine, sender, skip_tokens  # skip: positions the reader holds
        self._cuda = engine.device.type == "cuda"
        self._stream = torch.cuda.Stream(engine.device) if self._cuda else None
        self._events: dict[int, torch.cuda.Event] = {}
        self._written_at: dict[int, float] = {}

    def write_layer(self, layer: int, block_table, n_tokens: int) -> None:
        """Start copying layer `layer` of positions [skip, n_tokens) (from the engine loop's export hook)."""
        if n_tokens - self.skip != self.sender.layout.n_tokens:
            raise ValueError(f"{n_tokens - self.skip} tokens of KV for a slot of {self.sender.layout.n_tokens}")
        dst = torch.from_numpy(self.sender.layer_buffer(layer))  # [2, kv_heads, n_tokens - skip, dim], wire dtype
        src = self.engine.export_kv_blocks(block_table, layer, n_tokens)[:, :, self.skip:].to(dst.dtype)
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.engine.device))
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._events[layer] = event
        else:
            dst.copy_(src)
            self._written_at[layer] = time.time()

    def wait_layer(self, layer: int) -> LayerReady:
        """Block until layer `layer` is in the sender's memory; the message announcing it."""
        event = self._events.pop(layer, None)
        if event is not None:
            event.synchronize()
            self._written_at[layer] = time.time()
        return self.sender.layer_written(layer, self._written_at[layer])
