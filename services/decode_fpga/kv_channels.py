"""Where each piece of the KV cache lives in the device's memory channels.

The device cache is split into `n_channels` buffers (one per HBM pseudo-channel
on an FPGA; 1 by default on PoCL). The unit of placement is a *plane*: the K or V
of one (layer, kv_head) for one sequence slot, `max_context * head_dim` floats,
token-major like the wire layout. Planes go round-robin over the channels so
that the heads of a layer are read from different channels at once.

The mapping is pure: tests check it is a bijection for any channel count.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ChannelLayout:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_context: int
    n_slots: int
    n_channels: int

    def __post_init__(self) -> None:
        if self.n_channels < 1:
            raise ValueError(f"n_channels must be >= 1, got {self.n_channels}")

    @property
    def planes_per_slot(self) -> int:
        return self.n_layers * 2 * self.n_kv_heads

    @property
    def plane_elems(self) -> int:
        return self.max_context * self.head_dim

    def plane_index(self, layer: int, kv: int, head: int) -> int:
        return (layer * 2 + kv) * self.n_kv_heads + head

    def channel_planes(self, channel: int) -> int:
        """How many planes of one slot channel `channel` holds."""
        p, n = self.planes_per_slot, self.n_channels
        return p // n + (1 if channel < p % n else 0)

    def channel_elems(self, channel: int) -> int:
        return self.n_slots * self.channel_planes(channel) * self.plane_elems

    def locate(self, slot: int, layer: int, kv: int, head: int) -> tuple[int, int]:
        """(channel, element offset of the plane's token 0) for one plane of one slot."""
        plane = self.plane_index(layer, kv, head)
        channel, local = plane % self.n_channels, plane // self.n_channels
        return channel, (slot * self.channel_planes(channel) + local) * self.plane_elems


def wire_to_channels(layout: ChannelLayout, slot: int, wire: np.ndarray, channels: list[np.ndarray]) -> None:
    """Scatter a whole wire-layout KV ([layer, 2, kv_head, n_tokens, dim]) into host images of the channels."""
    n_tokens = wire.shape[3]
    for layer in range(layout.n_layers):
        for kv in range(2):
            for head in range(layout.n_kv_heads):
                ch, off = layout.locate(slot, layer, kv, head)
                channels[ch][off: off + n_tokens * layout.head_dim] = wire[layer, kv, head].reshape(-1)


def channels_to_wire(layout: ChannelLayout, slot: int, n_tokens: int, channels: list[np.ndarray]) -> np.ndarray:
    """Gather one slot's first n_tokens back into the wire layout (the inverse of wire_to_channels)."""
    out = np.empty((layout.n_layers, 2, layout.n_kv_heads, n_tokens, layout.head_dim), channels[0].dtype)
    for layer in range(layout.n_layers):
        for kv in range(2):
            for head in range(layout.n_kv_heads):
                ch, off = layout.locate(slot, layer, kv, head)
                out[layer, kv, head] = channels[ch][off: off + n_tokens * layout.head_dim].reshape(n_tokens, -1)
    return out
