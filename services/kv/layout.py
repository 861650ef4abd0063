"""The KV cache's wire layout, shared by whoever writes and reads it.

Per request: `[layer][k|v][kv_head][token][dim]`, only the `n_tokens` used.
One layer is therefore a contiguous block of 2 * n_kv_heads * n_tokens * head_dim
elements, and layer L starts at L times that.

`WIRE_DTYPES` is the one table of the element types the wire may carry: the name
settings and messages use, the code a slot header stores, the numpy dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.model.config import ModelConfig



@dataclass(frozen=True)
class WireDtype:
    name: str  # in settings and messages
    code: int  # in a slot header (header.py)
    numpy: np.dtype


WIRE_DTYPES: dict[str, WireDtype] = {d.name: d for d in (
    WireDtype("fp32", 1, np.dtype(np.float32)),  # the KV cache's own dtype on the CPU: identical tokens
    WireDtype("fp16", 2, np.dtype(np.float16)),  # half the bytes; an opt-in whose divergence is measured
)}


def wire_dtype(name: str) -> WireDtype:
    """The wire dtype called `name`; ValueError naming the known ones otherwise."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, not {name!r}")
    return WIRE_DTYPES[name]


def wire_dtype_of(dtype: np.dtype) -> WireDtype:
    """The wire dtype whose numpy dtype is `dtype`."""
    for d in WIRE_DTYPES.values():
        if d.numpy == dtype:
            return d
    raise ValueError(f"{dtype} is not a wire dtype ({', '.join(WIRE_DTYPES)})")


@dataclass(frozen=True)
class WireLayout:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_tokens: int
    dtype: np.dtype

    @classmethod
    def for_model(cls, cfg: ModelConfig, n_tokens: int, dtype: str = "fp32") -> "WireLayout":
        return cls(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_tokens, wire_dtype(dtype).numpy)

    @property
    def dtype_name(self) -> str:
        return wire_dtype_of(self.dtype).name

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (2, self.n_kv_heads, self.n_tokens, self.head_dim)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n_layers, *self.layer_shape)

    @property
    def layer_nbytes(self) -> int:
        return 2 * self.n_kv_heads * self.n_tokens * self.head_dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.n_layers * self.layer_nbytes

    def layer_offset(self, layer: int) -> int:
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.n_layers})")
        return layer * self.layer_nbytes

    def layer_view(self, buf: memoryview | np.ndarray, layer: int) -> np.ndarray:
        """Layer `layer` of a wire buffer as a [2, kv_heads, n_tokens, dim] array (no copy)."""
        raw = np.frombuffer(buf, dtype=np.uint8, count=self.layer_nbytes, offset=self.layer_offset(layer))
        return raw.view(self.dtype).reshape(self.layer_shape)
