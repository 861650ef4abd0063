"""Paged KV bookkeeping: fixed-size blocks, a free list, block tables, reference counts, prefix caching.
(Just past 300 lines on purpose: allocation, reference counts, the prefix cache's hashes and eviction
and the cut-back of a sequence's drafts all change the same tables, and their invariants are checked together.)

Pure Python (no torch, no OpenCL): it hands out block ids; the engines own the
memory those ids index. A sequence's block table lists the blocks holding its
positions in order: position p lives in slot p % block_size of block
table[p // block_size].

Prefix caching: once every token of a full block has its KV computed, the block
is registered under a hash of (its parent block's hash, its tokens). A new
sequence walks its prompt block by block and reuses the longest chain of
registered blocks. A hit is checked against the tokens kept with the block and
against the parent block it was computed after, so a hash collision can cost a
hit but never reuse the wrong KV. Blocks nobody references stay registered
(evictable) until the free list runs dry; then the least recently released one
is evicted first. A referenced block is never evicted.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from services.engine.host_kv_tier import HostKVTier
    from services.engine.kv_events import KVEventLog

KV_TENSORS = 2  # K and V


def blocks_for_budget(budget_bytes: int, n_layers: int, n_kv_heads: int, head_dim: int,
                      dtype_bytes: int, block_size: int) -> int:
    """How many KV blocks of `block_size` tokens (K and V, every layer) fit in `budget_bytes`."""
    dims = (n_layers, n_kv_heads, head_dim, dtype_bytes, block_size)
    if budget_bytes < 0 or min(dims) < 1:
        raise ValueError(f"need budget_bytes >= 0 and positive sizes, got {budget_bytes}, {dims}")
    bytes_per_block = KV_TENSORS * n_layers * n_kv_heads * head_dim * dtype_bytes * block_size
    return budget_bytes // bytes_per_block


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: its parent's key (b"" for the first block) and its tokens."""
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens it caches, checked on every hit
    parent_id: int | None = None  # the block it was computed after (None: first block)
    parent_hash: bytes = b""  # that block's key (the host tier verifies a hit by it)

    def forget(self) -> None:
        self.hash, self.token_ids, self.parent_id, self.parent_hash = None, (), None, b""


class BlockManager:
    """Owns every block id and each sequence's block table (keyed by seq_id)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 events: "KVEventLog | None" = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, holding nothing cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced but cached, LRU first
        self._cache: dict[bytes, int] = {}  # hash -> block id
        self._tables: dict[int, list[int]] = {}
        self._hashes: dict[int, list[bytes]] = {}  # seq_id -> keys of its leading computed full blocks
        self.events = events  # told of every hash registered and forgotten (kv_events.py: routers follow it)
        self.host_tier: "HostKVTier | None" = None  # evicted blocks kept in host memory (host_kv_tier.py)
        self.num_queried_tokens = 0  # prompt tokens looked up in the cache, for the hit ratio
        self.num_hit_tokens = 0

    # ---- capacity --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (cached but unreferenced ones count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables[seq_id])

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables

    # ---- a new sequence --------------------------------------------------------------------
    def cached_prefix_tokens(self, token_ids: Sequence[int], with_host_tier: bool = False) -> int:
        """How many leading positions of `token_ids` the prefix cache holds now (whole blocks),
        taking nothing: an allocation later may find fewer, if eviction came first. with_host_tier:
        also the blocks that go on in the host tier (an allocation loads them back)."""
        hits = self._cached_prefix(token_ids)
        n, bs = len(hits), self.block_size
        if with_host_tier and self.host_tier is not None and self.enable_prefix_caching:
            parent = self.blocks[hits[-1]].hash if hits else b""
            for i in range(n, (len(token_ids) - 1) // bs):
                tokens = tuple(token_ids[i * bs:(i + 1) * bs])
                key = hash_block(parent, tokens)
                if key in self._cache or not self.host_tier.holds(key, tokens, parent):
                    break
                n, parent = n + 1, key
        return n * bs

    def can_allocate(self, token_ids: Sequence[int], use_cache: bool = True,
                     max_cached_tokens: int | None = None) -> bool:
        hits = self._hits(token_ids, use_cache, max_cached_tokens)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # evictable now, taken then
        fresh = self.blocks_needed(len(token_ids)) - len(hits)
        return fresh + revived <= self.num_free_blocks

    def allocate(self, seq_id: int, token_ids: Sequence[int], use_cache: bool = True,
                 max_cached_tokens: int | None = None) -> int:
        """Give `seq_id` blocks for all of `token_ids`; return num_cached_tokens (KV already there).
        use_cache=False: fresh blocks only (KV that another engine computes is written into them);
        max_cached_tokens: take at most that many positions from the cache (the caller asked another
        engine for the rest, and must not get shared blocks to write into)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if not token_ids:
            raise ValueError("cannot allocate for an empty sequence")
        if not self.can_allocate(token_ids, use_cache, max_cached_tokens):
            raise RuntimeError(f"not enough free blocks for {len(token_ids)} tokens")
        hits = self._hits(token_ids, use_cache, max_cached_tokens)
        for block_id in hits:  # take the hits first, so the fresh blocks below cannot evict them
            self._ref(block_id)
        keys = [self.blocks[b].hash for b in hits]
        from_host = self._host_hits(token_ids, keys, max_cached_tokens) if use_cache else []
        table = hits + [self._take_free() for _ in range(self.blocks_needed(len(token_ids)) - len(hits))]
        for i, (key, tokens, saved) in enumerate(from_host, start=len(hits)):
            self.host_tier.load(saved, table[i])  # its KV back on the device: a hit like the others
            self._register(self.blocks[table[i]], key, tokens, table[i - 1] if i else None, keys[-1] if keys else b"")
            keys.append(key)
        self._tables[seq_id] = table
        self._hashes[seq_id] = keys
        num_cached_tokens = len(keys) * self.block_size
        if use_cache:
            self.num_queried_tokens += len(token_ids)
            self.num_hit_tokens += num_cached_tokens
        return num_cached_tokens

    def _host_hits(self, token_ids: Sequence[int], keys: list[bytes], max_cached_tokens: int | None) -> list:
        """Where the device's cached prefix ends, the blocks that go on along the prompt's hash chain in
        the host tier: [(key, tokens, saved block)]; at most len-1 tokens cached in all, as on the device."""
        if self.host_tier is None or not self.enable_prefix_caching:
            return []
        bs, found, parent = self.block_size, [], keys[-1] if keys else b""
        stop = (len(token_ids) - 1) // bs
        if max_cached_tokens is not None:
            stop = min(stop, max_cached_tokens // bs)
        for i in range(len(keys), stop):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            key = hash_block(parent, tokens)
            saved = None if key in self._cache else self.host_tier.lookup(key, tokens, parent)
            if saved is None:
                break
            found.append((key, tokens, saved))
            parent = key
        return found

    def _hits(self, token_ids: Sequence[int], use_cache: bool, max_cached_tokens: int | None) -> list[int]:
        hits = self._cached_prefix(token_ids) if use_cache else []
        return hits if max_cached_tokens is None else hits[:max_cached_tokens // self.block_size]

    def _cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest verified cached prefix. It stops short of the last token,
        whose logits the engine needs, so at most len-1 tokens come from the cache."""
        if not self.enable_prefix_caching:
            return []
        bs, parent_hash, parent_id, hits = self.block_size, b"", None, []
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent_hash = hash_block(parent_hash, tokens)
            block_id = self._cache.get(parent_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_id != parent_id:
                break  # a hash collision: same key, other content
            hits.append(block_id)
            parent_id = block_id
        return hits

    # ---- a growing sequence ----------------------------------------------------------------
    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Whether `seq_id` can grow to hold `num_tokens` positions."""
        return self._blocks_short(seq_id, num_tokens) <= self.num_free_blocks

    def append_slots(self, seq_id: int, num_tokens: int) -> None:
        """Grow `seq_id`'s table to hold `num_tokens` positions (a decode: its newest token)."""
        short = self._blocks_short(seq_id, num_tokens)
        if short > self.num_free_blocks:
            raise RuntimeError(f"not enough free blocks to grow sequence {seq_id} to {num_tokens} tokens")
        self._tables[seq_id].extend(self._take_free() for _ in range(short))

    def _blocks_short(self, seq_id: int, num_tokens: int) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(self._tables[seq_id]))

    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the blocks of `seq_id` that the first `num_computed_tokens` tokens fill.
        Call it after the engine computed them, never before: a hit must find the KV there."""
        if not self.enable_prefix_caching:
            return
        table, hashes, bs = self._tables[seq_id], self._hashes[seq_id], self.block_size
        if num_computed_tokens > len(table) * bs:
            raise ValueError(f"sequence {seq_id} holds {len(table)} blocks, not {num_computed_tokens} tokens")
        for i in range(len(hashes), num_computed_tokens // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            key = hash_block(hashes[-1] if hashes else b"", tokens)
            hashes.append(key)
            block = self.blocks[table[i]]
            if key in self._cache:
                # someone computed the same (or a colliding) block first; keep theirs. This block's
                # children then name this block as parent, so they are not found via theirs: a lost
                # hit, never a wrong one.
                continue
            self._register(block, key, tokens, table[i - 1] if i else None, hashes[-2] if i else b"")

    # ---- release ---------------------------------------------------------------------------
    def truncate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Cut `seq_id`'s table back to the blocks its first `num_tokens` positions need (speculation's
        rejected drafts had KV written past them); the freed block ids. Only blocks past every registered
        (full, hashed) one can go: their content was never a cached block's."""
        table = self._tables[seq_id]
        keep = max(self.blocks_needed(num_tokens), len(self._hashes[seq_id]))
        freed = table[keep:]
        del table[keep:]
        for block_id in freed:
            block = self.blocks[block_id]
            if block.hash is not None or block.ref_count != 1:
                raise RuntimeError(f"block {block_id} of sequence {seq_id} is shared or cached; not a draft's")
            block.ref_count = 0
            self._free.append(block_id)
        return freed

    def free(self, seq_id: int) -> list[int]:
        """Drop `seq_id`'s references; return its block table as it was."""
        table = self._tables.pop(seq_id)
        del self._hashes[seq_id]
        # last block first: a prompt's tail is then evicted before its head, which more
        # sequences are likely to share
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.hash is None:
                self._free.append(block_id)
            else:
                self._evictable[block_id] = None
        return table

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody references (what vLLM's reset_prefix_cache does for
        an operator); blocks in use keep their keys. Returns how many were forgotten."""
        n = len(self._evictable)
        if self.host_tier is not None:
            self.host_tier.clear()
        for block_id in self._evictable:
            self._forget(self.blocks[block_id])
            self._free.append(block_id)
        self._evictable.clear()
        return n

    # ---- internals -------------------------------------------------------------------------
    def _register(self, block: Block, key: bytes, tokens: tuple[int, ...], parent_id: int | None,
                  parent_hash: bytes) -> None:
        block.hash, block.token_ids, block.parent_id, block.parent_hash = key, tokens, parent_id, parent_hash
        self._cache[key] = block.block_id
        if self.events is not None:
            self.events.stored(key)

    def _forget(self, block: Block) -> None:
        """Take a cached block out of the prefix cache (evicted or reset)."""
        del self._cache[block.hash]
        if self.events is not None:
            self.events.removed(block.hash)
        block.forget()

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently released
            block = self.blocks[block_id]
            if self.host_tier is not None:  # its KV is still there: keep a copy before it is overwritten
                self.host_tier.save(block.hash, block.token_ids, block.parent_hash, block_id)
            self._forget(block)
        self.blocks[block_id].ref_count = 1
        return block_id
