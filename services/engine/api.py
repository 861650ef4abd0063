"""The contract every engine implements, so generation, services and tests treat them alike.

An engine owns a device and the model's weights on it. It does not sample
(except greedy argmax, which a device may do to avoid reading back logits) and
knows nothing of text or requests: token ids in, logits or token ids out.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

from services.model.config import ModelConfig

if TYPE_CHECKING:
    from services.engine.scheduler import ScheduledChunk


class EngineFull(RuntimeError):
    """The engine holds as many sequences as it can; a later request may fit (back-pressure)."""


class Engine(Protocol):
    cfg: ModelConfig
    device_name: str  # human-readable device, for Info and logs

    def new_sequence(self, capacity: int) -> Any:
        """Allocate KV for one sequence of up to `capacity` positions."""

    def prefill(self, seq: Any, token_ids: list[int], on_layer: Callable[[int], None] | None = None) -> np.ndarray:
        """Fill `seq` with the prompt; float32 logits of its last position, [vocab]."""

    def decode(self, seqs: list[Any], tokens: list[int]) -> np.ndarray:
        """Append one token to each sequence; float32 logits [B, vocab]."""

    def decode_greedy(self, seqs: list[Any], tokens: list[int]) -> list[int]:
        """As decode, but return each row's argmax (first index on ties), possibly computed on the device."""

    def import_kv_layer(self, seq: Any, layer: int, kv: np.ndarray) -> None:
        """Hybrid mode, receiving side: write one layer of wire-layout KV into positions [0, n_tokens).

        kv: [2 (k|v), n_kv_heads, n_tokens, head_dim], float32 or float16 (services/kv/layout.py).
        May only enqueue the copy; `finish_import` waits for all of them.
        """

    def finish_import(self, seq: Any, n_tokens: int) -> None:
        """All layers imported: wait until they are on the device and mark `n_tokens` positions filled."""

    def release(self, seq: Any) -> None:
        """Free the sequence's KV."""


class BatchEngine(Protocol):
    """What an engine offers the engine loop (services/engine/engine_loop.py) for continuous batching.

    KV lives in a paged pool of `num_blocks` blocks of `block_size` tokens, sized from a memory
    budget; the scheduler (services/engine/scheduler.py) hands out the block ids, the engine only
    reads and writes the blocks it is told. Position p of a sequence lives in slot p % block_size
    of block block_table[p // block_size].
    """

    cfg: ModelConfig
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int  # rows one step may compute

    def step(self, chunks: Sequence["ScheduledChunk"], greedy: bool,
             on_layer: Callable[[int], None] | None = None) -> list[int] | np.ndarray:
        """Compute every chunk (decodes first, then prefill chunks) in one forward.

        Chunk c is positions [c.start, c.start + c.num_tokens) of its sequence, tokens c.token_ids,
        attending to every position before them through c.block_table. For the chunks with
        c.samples, in order: greedy → each one's argmax token (first index on ties); else their
        float32 logits [n_sampling, vocab], where a chunk with c.all_logits (prompt logprobs; never in
        a greedy step) gives every row's, in order, its last row being its sampling row if it samples.
        `on_layer(l)`: layer l's K/V of every chunk is in the pool.
        A row's result does not depend on the other rows of the step (batch invariance).
        An engine whose `logprobs_on_device` is true also takes `logprobs=LogprobsAsked(k, targets)` in a
        greedy step (services/engine/logprobs.py) and then answers StepLogprobs: per logit row its argmax,
        its target's logprob and its k best, computed on the device instead of the logits read back.
        """

    def import_kv_blocks(self, block_table: Sequence[int], layer: int, kv: np.ndarray) -> None:
        """Hybrid, receiving side: one layer of wire-layout KV [2, n_kv_heads, n, head_dim] (fp32 or
        fp16) into positions [0, n) of the blocks; may only enqueue the copy."""

    def finish_import_blocks(self) -> None:
        """Wait until every imported layer is in the pool."""

    def read_kv_blocks(self, block_table: Sequence[int], n_tokens: int) -> np.ndarray:
        """Positions [0, n) in wire layout, [n_layers, 2, n_kv_heads, n, head_dim] float32 (tests, export)."""
