"""The forward's working buffers on the device.

Every buffer holds `max_rows` rows: the most a paged step computes. The step's launches are
bound to these buffers once (paged_plans.py), so they live as long as the engine; the rows'
token ids, sequences and positions are the step's int inputs (paged_step_rows.py).
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
    sync: cl.Buffer  # int32 [SYNC_LINE * (2 + 3 n_layers)]: decode_layers' failure flag, barrier arrivals
    #                  and each layer's work counters (two for one row, three for several)
    rope_cs: cl.Buffer  # [max_context, head_dim]: cos | sin of every position (paged_attention.cl's rope_table)

    @classmethod
    def allocate(cls, dev: DeviceContext, cfg: ModelConfig, rows: int, max_context: int) -> "Scratch":
        def buf(n: int, dtype=np.float32) -> cl.Buffer:
            return cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, n * np.dtype(dtype).itemsize)

        return cls(max_rows=rows, x=buf(rows * cfg.hidden), xn=buf(rows * cfg.hidden),
                   qkv=buf(rows * (cfg.q_dim + 2 * cfg.kv_dim)), attn=buf(rows * cfg.q_dim),
                   gu=buf(rows * 2 * cfg.intermediate), act=buf(rows * cfg.intermediate),
                   xn_sums=buf(rows * blocks32(cfg.hidden)), attn_sums=buf(rows * blocks32(cfg.q_dim)),
                   act_sums=buf(rows * blocks32(cfg.intermediate)),
                   sync=buf(SYNC_LINE * (2 + 3 * cfg.n_layers), np.int32), rope_cs=buf(max_context * cfg.head_dim))
