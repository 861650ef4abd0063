"""A second tier of prefix-cache blocks in host memory: what the device pool evicts, kept by hash and
loaded back on a prefix hit instead of recomputed.

The device's KV memory is the scarce tier (an FPGA's HBM holds 8-16 GB; here the pool's budget is a
setting, so a small one exercises this on PoCL). When the block manager evicts a cached block to
reuse it, the tier first copies that block's K/V out of the engine (`read_kv_blocks`: every layer,
[n_layers, 2, n_kv_heads, block_size, head_dim] fp32) under the block's hash, with its tokens and its
parent's hash to verify a later hit. When a prompt's cached prefix on the device ends, the block
manager goes on along the prompt's hash chain here; each block found is written into a fresh device
block (`import_kv_blocks`, layer by layer, the hybrid hand-off's path) and registered in the device
cache again. SGLang's HiCache and vLLM with LMCache keep such a tier; this one is bounded by bytes
and drops its least recently used blocks. It lives on the engine loop's thread (the block manager
calls it during schedule(), which owns the device), so it needs no lock.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from services.engine import metrics as m


@dataclass
class HostBlock:
    tokens: tuple[int, ...]
    parent_hash: bytes
    kv: np.ndarray  # [n_layers, 2, n_kv_heads, block_size, head_dim]


class HostKVTier:
    def __init__(self, engine, budget_bytes: int, block_size: int):
        self.engine, self.budget_bytes, self.block_size = engine, budget_bytes, block_size
        self._blocks: OrderedDict[bytes, HostBlock] = OrderedDict()  # least recently used first
        self.used_bytes = 0
        self.saved = self.loaded = 0  # blocks, for tests and the log

    def __len__(self) -> int:
        return len(self._blocks)

    def save(self, key: bytes, tokens: tuple[int, ...], parent_hash: bytes, block_id: int) -> None:
        """Copy device block `block_id` (about to be reused) out under `key`."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        t = time.perf_counter()
        kv = np.ascontiguousarray(self.engine.read_kv_blocks([block_id], self.block_size))
        if kv.nbytes > self.budget_bytes:
            return
        while self.used_bytes + kv.nbytes > self.budget_bytes:
            _, dropped = self._blocks.popitem(last=False)
            self.used_bytes -= dropped.kv.nbytes
        self._blocks[key] = HostBlock(tokens, parent_hash, kv)
        self.used_bytes += kv.nbytes
        self.saved += 1
        m.HOST_KV_BYTES.labels(direction="save").inc(kv.nbytes)
        m.HOST_KV_SECONDS.labels(direction="save").observe(time.perf_counter() - t)
        m.HOST_KV_USED_BYTES.set(self.used_bytes)

    def lookup(self, key: bytes, tokens: tuple[int, ...], parent_hash: bytes) -> HostBlock | None:
        """The block saved under `key` if it holds these tokens after this parent (a hash collision
        costs a hit, never wrong KV)."""
        block = self._blocks.get(key)
        if block is None or block.tokens != tokens or block.parent_hash != parent_hash:
            return None
        self._blocks.move_to_end(key)
        return block

    def holds(self, key: bytes, tokens: tuple[int, ...], parent_hash: bytes) -> bool:
        """Whether `lookup` would find the block, changing nothing (not even the LRU order): safe from
        a thread other than the engine loop's, for a hint."""
        block = self._blocks.get(key)
        return block is not None and block.tokens == tokens and block.parent_hash == parent_hash

    def load(self, block: HostBlock, block_id: int) -> None:
        """Write a saved block into device block `block_id`; waits until the device has it."""
        t = time.perf_counter()
        try:
            for layer in range(block.kv.shape[0]):
                self.engine.import_kv_blocks([block_id], layer, block.kv[layer])
        finally:  # the uploads have their own queue: none may still be pending once this returns or raises
            self.engine.finish_import_blocks()
        self.loaded += 1
        m.HOST_KV_HITS.inc(self.block_size)
        m.HOST_KV_BYTES.labels(direction="load").inc(block.kv.nbytes)
        m.HOST_KV_SECONDS.labels(direction="load").observe(time.perf_counter() - t)

    def clear(self) -> None:
        self._blocks.clear()
        self.used_bytes = 0
        m.HOST_KV_USED_BYTES.set(0)
