"""The receiving end of the transport tests: a real engine's paged pool, as decode_fpga's hybrid mode
receives (services/engine/block_import.py's BlockImport over a block table). Token slices, which only
the network transports' benchmarks send, are gathered on the host until finish_import imports each
layer whole. The tokens after the hand-off are decoded by the engine's step over the same blocks."""
from __future__ import annotations

import numpy as np

from services.engine.block_import import BlockImport
from tests.engine.step_calls import StepSequence


class BlockSink(BlockImport):
    """Blocks first_block, first_block + 1, ... of `engine`'s pool, room for `capacity` positions."""

    def __init__(self, engine, capacity: int, first_block: int = 0):
        super().__init__(engine, tuple(range(first_block, first_block + -(-capacity // engine.block_size))))
        self.length = 0  # positions imported, once finish_import ran
        self._slices: dict[int, list[np.ndarray]] = {}

    def import_kv_slice(self, seq, layer: int, start: int, kv: np.ndarray) -> None:
        """Positions [start, start + n) of one layer, kv [2, kv_heads, n, dim]; in order, each once."""
        got = self._slices.setdefault(layer, [])
        if sum(s.shape[2] for s in got) != start:
            raise ValueError(f"layer {layer}: a slice from {start} arrived out of order")
        got.append(np.array(kv))  # a copy: the transport's buffer is reused

    def finish_import(self, seq, n_tokens: int) -> None:
        for layer, parts in sorted(self._slices.items()):
            self.import_kv_layer(seq, layer, np.concatenate(parts, axis=2))
        self._slices.clear()
        super().finish_import(seq, n_tokens)
        self.length = n_tokens

    def kv(self, n_tokens: int | None = None) -> np.ndarray:
        """What the blocks hold: [n_layers, 2, n_kv_heads, n, head_dim] float32."""
        return self.engine.read_kv_blocks(self.block_table, n_tokens or self.length)

    def greedy_after(self, first: int, n_new: int) -> list[int]:
        """`first`, then greedy tokens decoded over the imported positions: n_new in all."""
        seq = StepSequence.over(self.engine, self.block_table, self.length)
        out = [first]
        while len(out) < n_new:
            out.append(int(np.argmax(seq.decode(out[-1]))))
        return out
