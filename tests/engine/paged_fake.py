"""A pure-Python BatchEngine for the engine loop's unit tests: KV is the token ids themselves.

Each step writes every chunk's tokens into the (block, slot) its block table names, and a
sampling chunk's next token is a hash of the context it *reads back through its table*:
a wrong table, a lost write or a wrong reuse of cached blocks changes the tokens, so the
tests see them. `next_token(context)` is the reference a correct run must reproduce.
"""
from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass

import numpy as np

VOCAB = 97


def next_token(context: list[int]) -> int:
    digest = hashlib.blake2b(np.asarray(context, np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def reference(prompt: list[int], max_tokens: int, eos: int | None = None) -> list[int]:
    out, context = [], list(prompt)
    for _ in range(max_tokens):
        token = next_token(context)
        out.append(token)
        context.append(token)
        if token == eos:
            break
    return out


@dataclass
class FakeConfig:
    vocab_size: int = VOCAB
    n_layers: int = 3


class PagedFakeEngine:
    def __init__(self, num_blocks: int, block_size: int = 4, max_num_batched_tokens: int = 64,
                 step_s: float = 0.002):
        self.cfg = FakeConfig()
        self.step_s = step_s  # a step takes a while, as on a device, so concurrent requests share steps
        self.num_blocks, self.block_size, self.max_num_batched_tokens = num_blocks, block_size, max_num_batched_tokens
        self.pool = np.full((num_blocks, block_size), -1, np.int64)
        self.steps: list[list[tuple[int, int, int]]] = []  # per step: (seq_id, start, num_tokens)
        self.fail_next = threading.Event()
        self.imported: list[tuple] = []

    def _at(self, table, p: int) -> tuple[int, int]:
        if p // self.block_size >= len(table):
            raise ValueError(f"position {p} is past the block table")
        block = table[p // self.block_size]
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} out of range")
        return block, p % self.block_size

    def step(self, chunks, greedy: bool, on_layer=None):
        if self.fail_next.is_set():
            self.fail_next.clear()
            raise RuntimeError("device lost")
        if sum(c.num_tokens for c in chunks) > self.max_num_batched_tokens:
            raise ValueError("too many rows")
        self.steps.append([(c.seq_id, c.start, c.num_tokens) for c in chunks])
        time.sleep(self.step_s)
        for c in chunks:
            for i, token in enumerate(c.token_ids):
                self.pool[self._at(c.block_table, c.start + i)] = token
        for layer in range(self.cfg.n_layers):
            if on_layer is not None:
                on_layer(layer)
        picks = []
        for c in chunks:
            if c.samples:
                end = c.start + c.num_tokens
                picks.append(next_token([int(self.pool[self._at(c.block_table, p)]) for p in range(end)]))
        if greedy:
            return picks
        logits = np.zeros((len(picks), VOCAB), np.float32)
        logits[np.arange(len(picks)), picks] = 50.0  # sampling at any temperature picks it
        return logits

    def import_kv_blocks(self, block_table, layer: int, kv: np.ndarray) -> None:
        self.imported.append((tuple(block_table), layer))
        if layer == 0:
            for p, token in enumerate(kv):
                self.pool[self._at(block_table, p)] = token

    def finish_import_blocks(self) -> None:
        pass

    def tokens_at(self, block_table, n: int) -> list[int]:
        return [int(self.pool[self._at(block_table, p)]) for p in range(n)]
