"""The contract every engine implements (BatchEngine: the paged step), so the engine loop, services,
tools and tests treat them alike.

An engine owns a device, the model's weights on it and a paged KV pool. It does not sample
(except greedy argmax, which a device may do to avoid reading back logits) and knows nothing of
text or requests: the scheduler's chunks in, logits or token ids out. Every request reaches it
through an engine loop (engine_loop.py): a service's, or a tool's own (one_request.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np

from services.model.config import ModelConfig

if TYPE_CHECKING:
    from services.engine.scheduler import ScheduledChunk


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
