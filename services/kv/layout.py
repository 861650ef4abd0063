"""The KV cache's wire layout, shared by whoever writes and reads it.

Per request: `[layer][k|v][kv_head][token][dim]`, only the `n_tokens` used.
One layer is therefore a contiguous block of 2 * n_kv_heads * n_tokens * head_dim
elements, and layer L starts at L times that.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.model.config import ModelConfig

WIRE_DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16)}


@dataclass(frozen=True)
class WireLayout:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_tokens: int
    dtype: np.dtype

    @classmethod
    def for_model(cls, cfg: ModelConfig, n_tokens: int, dtype: str = "fp32") -> "WireLayout":
        return cls(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_tokens, WIRE_DTYPES[dtype])

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
