"""The KV cache on the device: sequences, where their KV lives, and KV handed off by prefill_gpu.

Today every sequence holds one slot of `max_context` positions, each slot's K and
V planes spread over the memory channels (kv_channels.py). The interface speaks of
sequences; only `plane` and `layer_bases` (what the attention kernels are bound
to) know about slots.

Not thread-safe: the engine calls it under its lock.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyopencl as cl

from services.decode_fpga.device import DeviceContext
from services.decode_fpga.kv_channels import ChannelLayout, channels_to_wire
from services.engine.api import EngineFull
from services.model.config import ModelConfig


@dataclass
class OpenCLSequence:
    slot: int  # where its KV lives; -1 once released
    capacity: int  # positions it may fill
    length: int = 0  # positions filled
    _keep_alive: list = field(default_factory=list)  # host arrays of non-blocking uploads


class KVStore:
    """fp32 K and V of up to max_sequences sequences of max_context positions each."""

    def __init__(self, dev: DeviceContext, cfg: ModelConfig, max_context: int, max_sequences: int,
                 n_channels: int):
        self.dev, self.cfg = dev, cfg
        self.max_context, self.max_sequences = max_context, max_sequences
        self.layout = ChannelLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_context, max_sequences,
                                    n_channels)
        self.channels = [cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, max(4, self.layout.channel_elems(c) * 4))
                         for c in range(n_channels)]
        self._free_slots = list(range(max_sequences))

    @property
    def nbytes(self) -> int:
        return sum(self.layout.channel_elems(c) * 4 for c in range(self.layout.n_channels))

    # ---- sequences ----------------------------------------------------------
    def new_sequence(self, capacity: int) -> OpenCLSequence:
        if capacity > self.max_context:
            raise ValueError(f"sequence of {capacity} positions exceeds the engine's context of {self.max_context}")
        if not self._free_slots:
            raise EngineFull(f"all {self.max_sequences} sequence slots of the OpenCL engine are in use")
        return OpenCLSequence(self._free_slots.pop(0), capacity)

    def release(self, seq: OpenCLSequence) -> None:
        if seq.slot >= 0 and seq.slot not in self._free_slots:
            self._free_slots.append(seq.slot)
        seq.slot = -1

    @property
    def free_sequences(self) -> int:
        """How many more sequences new_sequence would give now."""
        return len(self._free_slots)

    # ---- KV handed off by prefill_gpu ---------------------------------------------
    def import_layer(self, seq: OpenCLSequence, layer: int, kv: np.ndarray) -> None:
        """Enqueue the copy of one layer's wire-layout KV, [2 (k|v), n_kv_heads, n_tokens, head_dim] fp32 or
        fp16, into the sequence's positions [0, n_tokens); finish_import waits for every copy."""
        c = self.cfg
        if kv.ndim != 4 or kv.shape[:2] != (2, c.n_kv_heads) or kv.shape[3] != c.head_dim:
            raise ValueError(f"KV of layer {layer} has shape {kv.shape}, expected (2, {c.n_kv_heads}, n, {c.head_dim})")
        if kv.shape[2] > seq.capacity:
            raise ValueError(f"{kv.shape[2]} tokens do not fit the sequence's {seq.capacity} positions")
        host = np.ascontiguousarray(kv, np.float32)  # fp16 on the wire is widened here
        seq._keep_alive.append(host)
        for k_or_v in range(2):
            for h in range(c.n_kv_heads):
                ch, off = self.layout.locate(seq.slot, layer, k_or_v, h)
                cl.enqueue_copy(self.dev.queue, self.channels[ch], host[k_or_v, h], dst_offset=off * 4,
                                is_blocking=False)

    def finish_import(self, seq: OpenCLSequence, n_tokens: int) -> None:
        self.dev.queue.finish()
        seq._keep_alive.clear()
        seq.length = n_tokens

    def read(self, seq: OpenCLSequence, n_tokens: int) -> np.ndarray:
        """The sequence's first n_tokens of KV in wire layout, [n_layers, 2, n_kv_heads, n_tokens, head_dim]
        fp32 (tests and debugging)."""
        host = []
        for c, buf in enumerate(self.channels):
            a = np.empty(max(1, self.layout.channel_elems(c)), np.float32)
            cl.enqueue_copy(self.dev.queue, a, buf, is_blocking=True)
            host.append(a)
        return channels_to_wire(self.layout, seq.slot, n_tokens, host)

    # ---- what the attention kernels are bound to ---------------------------------
    def plane(self, layer: int, kv: int, head: int) -> tuple[cl.Buffer, np.int64, np.int64]:
        """The K (kv 0) or V (kv 1) plane of (layer, head): its channel buffer, the element offset of
        slot 0's plane and the stride from one slot's plane to the next."""
        ch, base = self.layout.locate(0, layer, kv, head)
        _, slot1 = self.layout.locate(1, layer, kv, head) if self.layout.n_slots > 1 else (ch, base)
        return self.channels[ch], np.int64(base), np.int64(slot1 - base)

    def layer_bases(self) -> np.ndarray:
        """int64 [n_layers, 2]: the element offset of slot 0's head-0 K and V plane of every layer (one channel)."""
        return np.array([[self.plane(li, kv, 0)[1] for kv in (0, 1)] for li in range(self.cfg.n_layers)], np.int64)
