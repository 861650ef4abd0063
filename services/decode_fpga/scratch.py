"""The forward's working buffers on the device, and the rows (token, slot, position) it runs over.

Every buffer holds `max_rows` rows: a prefill chunk or one row per sequence of a
decode step. The launch plans are bound to these buffers once, so they live as
long as the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyopencl as cl

from services.decode_fpga.device import DeviceContext
from services.model.config import ModelConfig

SYNC_LINE = 16  # decode_layers.cl's counters are SYNC_LINE ints apart (a cache line each)


def blocks32(cols: int) -> int:
    """32-column blocks of a row (the last may be short)."""
    return (cols + 31) // 32


@dataclass(frozen=True)
class Scratch:
    max_rows: int
    tokens: cl.Buffer  # int32 [rows]: the rows' token ids
    slots: cl.Buffer  # int32 [rows]: where each row's sequence keeps its KV
    pos: cl.Buffer  # int32 [rows]: each row's position
    x: cl.Buffer  # [rows, hidden]: the residual stream
    xn: cl.Buffer  # [rows, hidden]: x normalized
    qkv: cl.Buffer  # [rows, q_dim + 2 kv_dim]
    attn: cl.Buffer  # [rows, q_dim]: attention's output
    gu: cl.Buffer  # [rows, 2 ff]: gate | up
    act: cl.Buffer  # [rows, ff]: silu(gate) * up
    # the sums of xn, attn and act over 32-column blocks, written beside them (Q4_1 GEMVs read them)
    xn_sums: cl.Buffer  # [rows, blocks32(hidden)]
    attn_sums: cl.Buffer  # [rows, blocks32(q_dim)]
    act_sums: cl.Buffer  # [rows, blocks32(ff)]
    logits: cl.Buffer  # [max_sequences, vocab]
    last: cl.Buffer  # [hidden]: a prefill's last row, for its logits
    sync: cl.Buffer  # int32 [SYNC_LINE * (2 + 2 n_layers)]: decode_layers' failure flag, barrier arrivals
    #                  and each layer's two work counters
    rope_cs: cl.Buffer  # [max_context, head_dim]: cos | sin of every position (attention.cl's rope_table)

    @classmethod
    def allocate(cls, dev: DeviceContext, cfg: ModelConfig, rows: int, max_sequences: int,
                 max_context: int) -> "Scratch":
        def buf(n: int, dtype=np.float32) -> cl.Buffer:
            return cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, n * np.dtype(dtype).itemsize)

        return cls(max_rows=rows, tokens=buf(rows, np.int32), slots=buf(rows, np.int32), pos=buf(rows, np.int32),
                   x=buf(rows * cfg.hidden), xn=buf(rows * cfg.hidden), qkv=buf(rows * (cfg.q_dim + 2 * cfg.kv_dim)),
                   attn=buf(rows * cfg.q_dim), gu=buf(rows * 2 * cfg.intermediate), act=buf(rows * cfg.intermediate),
                   xn_sums=buf(rows * blocks32(cfg.hidden)), attn_sums=buf(rows * blocks32(cfg.q_dim)),
                   act_sums=buf(rows * blocks32(cfg.intermediate)), logits=buf(max_sequences * cfg.vocab_size),
                   last=buf(cfg.hidden), sync=buf(SYNC_LINE * (2 + 2 * cfg.n_layers), np.int32),
                   rope_cs=buf(max_context * cfg.head_dim))


class RowInputs:
    """Uploads a step's rows (token ids, slots, positions) into the scratch buffers, unless the device
    holds them already: a greedy step leaves its picks and next positions there (argmax_rows)."""

    def __init__(self, queue: cl.CommandQueue, scratch: Scratch):
        self._queue, self._buffers = queue, (scratch.tokens, scratch.slots, scratch.pos)
        self._on_device: tuple | None = None  # (tokens, slots, positions) the three buffers hold

    def upload(self, tokens, slots, positions, keep: list) -> None:
        """tokens, slots, positions: sequences of ints, one per row; keep holds the host arrays."""
        rows = (tuple(tokens), tuple(slots), tuple(positions))
        if rows == self._on_device:
            return
        for b, a in zip(self._buffers, rows):
            a = np.array(a, np.int32)
            keep.append(a)
            cl.enqueue_copy(self._queue, b, a, is_blocking=False)
        self._on_device = rows

    def forget(self) -> None:
        """The buffers' contents are unknown (a step rewrites them, or is void)."""
        self._on_device = None

    def left_by_argmax(self, picks: list[int], slots, positions) -> None:
        """A greedy step's argmax_rows left these rows: its picks at the next positions."""
        self._on_device = (tuple(picks), tuple(slots), tuple(positions))
