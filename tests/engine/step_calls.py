"""An engine's paged step called directly in tests, outside any engine loop: a chunk, a prompt's logits."""
from __future__ import annotations

import numpy as np

from services.engine.sequence import ScheduledChunk


def chunk(seq_id: int, start: int, tokens, table, samples: bool = True) -> ScheduledChunk:
    """Positions [start, start + len(tokens)) of sequence seq_id, over its block table."""
    return ScheduledChunk(seq_id, start, tuple(int(t) for t in tokens), tuple(int(b) for b in table), samples, None)


def prompt_logits(engine, prompt: list[int], first_block: int = 0) -> np.ndarray:
    """The logits after the prompt [vocab], the prompt in one chunk over blocks first_block, first_block + 1, ..."""
    table = tuple(range(first_block, first_block + -(-len(prompt) // engine.block_size)))
    return engine.step([chunk(0, 0, prompt, table)], greedy=False)[0]


class StepSequence:
    """One sequence over blocks first_block, first_block + 1, ... of the engine's pool, its steps
    called directly: a prompt in one chunk, then one token a step."""

    def __init__(self, engine, capacity: int, first_block: int = 0, seq_id: int = 0):
        self.engine, self.seq_id, self.length = engine, seq_id, 0
        self.table = tuple(range(first_block, first_block + -(-capacity // engine.block_size)))

    @classmethod
    def over(cls, engine, table: tuple[int, ...], length: int, seq_id: int = 0) -> "StepSequence":
        """A sequence whose first `length` positions are in the blocks of `table` already (imported)."""
        seq = cls.__new__(cls)
        seq.engine, seq.seq_id, seq.length, seq.table = engine, seq_id, length, tuple(table)
        return seq

    def prefill(self, prompt: list[int]) -> np.ndarray:
        """The prompt's logits after its last position [vocab]."""
        return self._step(prompt)

    def decode(self, token: int) -> np.ndarray:
        """`token` appended; the logits after it [vocab]."""
        return self._step([token])

    def _step(self, tokens: list[int]) -> np.ndarray:
        out = self.engine.step([chunk(self.seq_id, self.length, tokens, self.table)], greedy=False)[0]
        self.length += len(tokens)
        return np.asarray(out)
