"""The torch engine's paged KV pool: one tensor of fixed-size blocks, addressed through block tables.

Layout, heads-major: `data[layer, k|v, kv_head, slot, dim]` with slot = block * block_size + offset,
so position p of a sequence lives in slot table[p // block_size] * block_size + p % block_size.
Why: a gather along the slot axis (one `index_select` per layer, for any set of positions: every
decode's whole context through its block table) comes out as [2, kv_heads, n, dim], contiguous,
which is both what attention's batched matmuls read without another copy and the wire layout
[2, n_kv_heads, n, head_dim] of the hybrid hand-off. Writing a step's rows is one `index_copy_`.

Block ids come from the scheduler's BlockManager; the pool only checks that they index memory it has.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from services.engine.block_manager import blocks_for_budget
from services.model.config import ModelConfig


def kv_dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class PagedKVPool:
    def __init__(self, cfg: ModelConfig, kv_cache_mb: int, block_size: int, device: torch.device,
                 dtype: torch.dtype):
        self.cfg, self.block_size, self.device, self.dtype = cfg, block_size, device, dtype
        self.num_blocks = blocks_for_budget(kv_cache_mb << 20, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                                            kv_dtype_bytes(dtype), block_size)
        if self.num_blocks < 1:
            raise ValueError(f"a KV budget of {kv_cache_mb} MiB holds no block of {block_size} tokens")
        # one block past the budget that no block table names: the padding rows of a fixed-shape
        # (CUDA graph) step write their K/V there (cuda_graphs.py)
        self.scratch_block = self.num_blocks
        # on the CPU torch.empty: pages are touched only when a block is first written. On CUDA zeros:
        # a masked position may be read (times an attention weight of exactly 0), so none may be NaN
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.data = alloc((cfg.n_layers, 2, cfg.n_kv_heads, (self.num_blocks + 1) * block_size,
                                 cfg.head_dim), device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    # ---- addressing ------------------------------------------------------------------------
    def slots(self, block_table: Sequence[int], start: int, stop: int) -> np.ndarray:
        """Flat slot of each position in [start, stop) through `block_table`, int64 [stop - start].

        Raises ValueError when the table does not reach `stop` or names a block the pool lacks."""
        bs = self.block_size
        n_blocks = -(-stop // bs)
        if start < 0 or stop <= start:
            raise ValueError(f"empty or negative position range [{start}, {stop})")
        if n_blocks > len(block_table):
            raise ValueError(f"position {stop - 1} is past the block table ({len(block_table)} blocks of {bs})")
        table = np.asarray(block_table[:n_blocks], dtype=np.int64)
        if table.min() < 0 or table.max() >= self.num_blocks:
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {table.tolist()}")
        positions = np.arange(start, stop, dtype=np.int64)
        return table[positions // bs] * bs + positions % bs

    def index(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(slots).to(self.device)

    # ---- one layer -------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, n_kv_heads, head_dim] into the n slots."""
        self.data[layer].index_copy_(2, slots, torch.stack([k, v]).transpose(1, 2))

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The slots' K and V, [2, n_kv_heads, slots.numel(), head_dim] (a contiguous copy)."""
        return self.data[layer].index_select(2, slots.reshape(-1))

    # ---- wire layout (hybrid hand-off, tests) ----------------------------------------------
    def import_layer(self, block_table: Sequence[int], layer: int, kv: np.ndarray) -> None:
        """Wire-layout kv [2, n_kv_heads, n, head_dim] (fp32 or fp16) into positions [0, n)."""
        c = self.cfg
        if not 0 <= layer < c.n_layers:
            raise ValueError(f"layer {layer} is not in [0, {c.n_layers})")
        if kv.ndim != 4 or kv.shape[0] != 2 or kv.shape[1] != c.n_kv_heads or kv.shape[3] != c.head_dim \
                or kv.shape[2] < 1:
            raise ValueError(f"kv must be [2, {c.n_kv_heads}, n >= 1, {c.head_dim}], got {kv.shape}")
        if kv.dtype not in (np.float32, np.float16):
            raise ValueError(f"kv must be float32 or float16, got {kv.dtype}")
        slots = self.index(self.slots(block_table, 0, kv.shape[2]))
        src = torch.from_numpy(np.ascontiguousarray(kv)).to(self.device, self.dtype)  # [2, kvh, n, dim]
        self.data[layer].index_copy_(2, slots, src)

    def export_layer(self, block_table: Sequence[int], layer: int, n_tokens: int) -> torch.Tensor:
        """Positions [0, n) of one layer in wire layout [2, n_kv_heads, n, head_dim], on the device."""
        if not 0 <= layer < self.cfg.n_layers:
            raise ValueError(f"layer {layer} is not in [0, {self.cfg.n_layers})")
        return self.gather(layer, self.index(self.slots(block_table, 0, n_tokens)))

    def read(self, block_table: Sequence[int], n_tokens: int) -> np.ndarray:
        """Positions [0, n) of every layer, [n_layers, 2, n_kv_heads, n, head_dim] float32."""
        slots = self.index(self.slots(block_table, 0, n_tokens))
        return self.data.index_select(3, slots).float().cpu().numpy()
