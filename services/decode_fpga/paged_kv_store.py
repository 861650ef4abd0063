"""The paged KV pool on the device (the continuous-batching path), and KV handed in and out of its blocks.

The pool is one float32 buffer laid out as paged_attention.py's PagedKVLayout, sized
from a memory budget; the scheduler owns the block ids, this store only reads and
writes the blocks it is told (services/engine/api.py's BatchEngine). A hand-off's
layer is uploaded whole into a staging buffer and scattered into its blocks by
paged_kv_write (kernels/paged_attention.cl), which reads the wire layout in place:
one copy and one launch per layer, whatever the blocks.

Imports go on a queue of their own, under a lock of their own: a hand-off's blocks are reserved
for it alone, no step reads them before the request joins the batch (after finish_import), so a
layer need not wait for the step running on the engine's queue. Behind the engine's lock and
queue, each of a hand-off's 30 layers waited for a step: under load (steps stretched up to 2 s)
the exposed hand-off took 2.5-10 s a request at 32 clients. Everything else is not thread-safe:
the engine calls it under its lock.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import pyopencl as cl

from services.decode_fpga.device import DeviceContext
from services.decode_fpga.paged_attention import PagedAttention, PagedKVLayout
from services.model.config import ModelConfig

MF = cl.mem_flags
MIB = 1 << 20


def check_block_table(layout: PagedKVLayout, block_table: Sequence[int], n_tokens: int, max_tokens: int) -> list[int]:
    """The blocks holding positions [0, n_tokens) of a table, after checking they are blocks of the
    pool and that n_tokens fits both the table and max_tokens; ValueError otherwise."""
    if not 0 < n_tokens <= max_tokens:
        raise ValueError(f"{n_tokens} positions: need 1 to {max_tokens}")
    used = -(-n_tokens // layout.block_size)
    if used > len(block_table):
        raise ValueError(f"{n_tokens} positions need {used} blocks, the table holds {len(block_table)}")
    ids = [int(b) for b in block_table[:used]]
    if min(ids) < 0 or max(ids) >= layout.num_blocks:
        raise ValueError(f"block table {ids} names a block outside [0, {layout.num_blocks})")
    return ids


class PagedKVStore:
    """fp32 K and V of every layer in `layout.num_blocks` blocks of `layout.block_size` tokens."""

    def __init__(self, dev: DeviceContext, cfg: ModelConfig, layout: PagedKVLayout, max_tokens: int):
        if (layout.n_layers, layout.n_kv_heads, layout.head_dim) != (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
            raise ValueError(f"paged layout {layout} does not fit the model")
        self.dev, self.cfg, self.layout, self.max_tokens = dev, cfg, layout, max_tokens
        self.max_blocks = -(-max_tokens // layout.block_size)  # a block table's length at most
        self.pool = layout.allocate(dev)
        self.kernels = PagedAttention(dev, layout, cfg.n_heads)
        # the import's staging: one layer of wire KV, positions [0, max_tokens) and a one-row table
        self._staging = cl.Buffer(dev.context, MF.READ_ONLY, 2 * cfg.kv_dim * max_tokens * 4)
        positions = np.arange(max_tokens, dtype=np.int32)
        self._positions = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=positions)
        self._zeros = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.zeros(max_tokens, np.int32))
        self._table = cl.Buffer(dev.context, MF.READ_ONLY, self.max_blocks * 4)
        self._keep_alive: list = []  # host arrays of copies not yet waited for
        # the imports' own in-order queue (the staging buffer is reused layer after layer in its
        # order) and lock (hand-offs on several threads; finish_import clears what they keep alive)
        self._import_queue = cl.CommandQueue(dev.context, dev.device)
        self._import_lock = threading.Lock()

    @classmethod
    def from_budget(cls, dev: DeviceContext, cfg: ModelConfig, kv_cache_mb: int, block_size: int,
                    max_tokens: int) -> "PagedKVStore":
        layout = PagedKVLayout.from_budget(kv_cache_mb * MIB, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, block_size)
        return cls(dev, cfg, layout, max_tokens)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    # ---- KV handed off by prefill_gpu -------------------------------------------------
    def import_layer(self, block_table: Sequence[int], layer: int, kv: np.ndarray) -> None:
        """Enqueue one layer of wire-layout KV, [2 (k|v), n_kv_heads, n, head_dim] fp32 or fp16, into
        positions [0, n) of the table's blocks, on the imports' queue; finish_import waits for every
        copy. Thread-safe, and never behind a step: the blocks must be no running sequence's."""
        c = self.cfg
        if kv.ndim != 4 or kv.shape[:2] != (2, c.n_kv_heads) or kv.shape[3] != c.head_dim:
            raise ValueError(f"KV of layer {layer} has shape {kv.shape}, expected (2, {c.n_kv_heads}, n, {c.head_dim})")
        n = kv.shape[2]
        ids = check_block_table(self.layout, block_table, n, self.max_tokens)
        self.layout.layer_base(layer)  # checks the layer
        host = np.ascontiguousarray(kv, np.float32)  # fp16 on the wire is widened here, exactly
        table = np.array(ids, np.int32)
        hd = c.head_dim
        # wire rows: K of (token t, head h) at h n hd + t hd, its V 2... n_kv n hd further
        write = self.kernels.bind_kv_write(n, self._staging, 0, hd, c.n_kv_heads * n * hd, n * hd, self._zeros,
                                           self._positions, self._table, self.max_blocks, self.pool, layer)
        with self._import_lock:
            self._keep_alive += [host, table]
            q = self._import_queue
            cl.enqueue_copy(q, self._staging, host, is_blocking=False)
            cl.enqueue_copy(q, self._table, table, is_blocking=False)
            write.enqueue(q)

    def finish_import(self) -> None:
        """Wait for every import enqueued so far (other hand-offs' too)."""
        with self._import_lock:
            self._import_queue.finish()
            self._keep_alive.clear()

    def read(self, block_table: Sequence[int], n_tokens: int) -> np.ndarray:
        """Positions [0, n_tokens) in wire layout, [n_layers, 2, n_kv_heads, n_tokens, head_dim] float32."""
        ids = check_block_table(self.layout, block_table, n_tokens, self.max_tokens)
        lay = self.layout
        per_block = lay.block_stride  # floats of one block of one layer
        host = np.empty((lay.n_layers, len(ids), 2, lay.n_kv_heads, lay.block_size, lay.head_dim), np.float32)
        for li in range(lay.n_layers):
            for i, b in enumerate(ids):
                cl.enqueue_copy(self.dev.queue, host[li, i], self.pool,
                                src_offset=(lay.layer_base(li) + b * per_block) * 4, is_blocking=False)
        self.dev.queue.finish()
        # [L, blocks, 2, H, bs, D] → [L, 2, H, blocks * bs, D], then the first n_tokens positions
        wire = host.transpose(0, 2, 3, 1, 4, 5).reshape(lay.n_layers, 2, lay.n_kv_heads, -1, lay.head_dim)
        return np.ascontiguousarray(wire[:, :, :, :n_tokens])
