"""The paged KV pool on the OpenCL device: its layout, its allocation from a byte budget, the
launchers of kernels/paged_attention.cl, and their numpy reference.

Pool layout (one buffer, float32):

    pool[layer][block][k|v][kv_head][slot][dim]   shape [n_layers, num_blocks, 2, n_kv_heads, block_size, head_dim]

Position p of a sequence lives in slot p % block_size of block block_table[p // block_size]
(services/engine/block_manager.py's convention). One head's K (or V) in one block is
block_size * head_dim contiguous floats, so the kernels read it with wide loads and look the
table up once per block.

The reference computes in float64: the kernels' float32 sums run in an order numpy cannot
reproduce, so no float32 reference would match them bit for bit anyway, and float64 keeps the
reference's own error far below the tolerance the kernels are held to. Bit-identity is checked
kernel against kernel instead (a row alone vs in a batch; the CPU's scores kernels vs the portable ones).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyopencl as cl

from services.decode_fpga.device import DeviceContext
from services.decode_fpga.launch import Launch, bind
from services.engine.block_manager import blocks_for_budget

FLOAT_BYTES = 4
NO_BLOCK = -1  # padding of a packed block table past a sequence's blocks


@dataclass(frozen=True)
class PagedKVLayout:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        if min(self.n_layers, self.n_kv_heads, self.block_size, self.num_blocks) < 1:
            raise ValueError(f"every size must be >= 1: {self}")
        if self.head_dim < 4 or self.head_dim % 4:
            raise ValueError(f"head_dim must be a positive multiple of 4 (vload4), got {self.head_dim}")

    @classmethod
    def from_budget(cls, budget_bytes: int, n_layers: int, n_kv_heads: int, head_dim: int,
                    block_size: int = 16) -> PagedKVLayout:
        """As many blocks as fit in `budget_bytes` (K and V of every layer, float32)."""
        num_blocks = blocks_for_budget(budget_bytes, n_layers, n_kv_heads, head_dim, FLOAT_BYTES, block_size)
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens")
        return cls(n_layers, n_kv_heads, head_dim, block_size, num_blocks)

    @property
    def block_elems(self) -> int:
        """One head's K (or V) in one block."""
        return self.block_size * self.head_dim

    @property
    def block_stride(self) -> int:
        """One block of one layer: K of every head, then V."""
        return 2 * self.n_kv_heads * self.block_elems

    @property
    def layer_elems(self) -> int:
        return self.num_blocks * self.block_stride

    @property
    def nbytes(self) -> int:
        return self.n_layers * self.layer_elems * FLOAT_BYTES

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.n_layers, self.num_blocks, 2, self.n_kv_heads, self.block_size, self.head_dim)

    def layer_base(self, layer: int) -> int:
        """Element offset of `layer`'s blocks: the kernels' layer_base argument."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.n_layers})")
        return layer * self.layer_elems

    def allocate(self, dev: DeviceContext) -> cl.Buffer:
        """The pool's device buffer (uninitialised)."""
        limit = dev.device.max_mem_alloc_size
        if self.nbytes > limit:
            raise ValueError(f"KV pool of {self.nbytes} bytes exceeds the device's largest buffer ({limit} bytes)")
        return cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, self.nbytes)


def scores_positions(max_positions: int) -> int:
    """paged_attention_scores' MAX_POS for tables of `max_positions`: the next power of two, at least
    1024, so that pools of nearby sizes (every max_context a test or a setting asks for) share one
    program instead of each compiling its own (0.5-1 s on PoCL)."""
    return max(1024, 1 << (max_positions - 1).bit_length())


def pack_block_tables(tables: Sequence[Sequence[int]], max_blocks: int) -> np.ndarray:
    """[n_seqs, max_blocks] int32 of the tables, padded with NO_BLOCK: the kernels' block_tables."""
    if any(len(t) > max_blocks for t in tables):
        raise ValueError(f"a block table is longer than max_blocks={max_blocks}")
    packed = np.full((max(1, len(tables)), max_blocks), NO_BLOCK, np.int32)
    for i, t in enumerate(tables):
        packed[i, :len(t)] = t
    return packed


def check_rows(layout: PagedKVLayout, packed_tables: np.ndarray, seq_of_row: np.ndarray, pos: np.ndarray) -> None:
    """Every table entry a launch over these rows reads or writes is a block of the pool: guards the
    device's writes (a kernel cannot raise). pos[r]: the last position row r touches."""
    if seq_of_row.shape != pos.shape or seq_of_row.ndim != 1:
        raise ValueError(f"seq_of_row {seq_of_row.shape} and pos {pos.shape} must be equal 1-D shapes")
    if len(pos) and (seq_of_row.min() < 0 or seq_of_row.max() >= len(packed_tables) or pos.min() < 0):
        raise ValueError("a row names a sequence without a table, or a negative position")
    max_blocks = packed_tables.shape[1]
    for s, p in zip(seq_of_row.tolist(), pos.tolist()):
        used = p // layout.block_size + 1
        if used > max_blocks:
            raise ValueError(f"position {p} needs {used} blocks, the table holds {max_blocks}")
        ids = packed_tables[s, :used]
        if ids.min() < 0 or ids.max() >= layout.num_blocks:
            raise ValueError(f"sequence {s}'s table {ids.tolist()} names a block outside [0, {layout.num_blocks})")


class PagedAttention:
    """Launchers of kernels/paged_attention.cl for one model shape, bound once and replayed.

    Buffers: qkv [rows, q_dim + 2 kv_dim] f32, seq_of_row [rows] i32, pos [rows] i32, block_tables
    [n_seqs, max_blocks] i32, rope_cs [max_pos, head_dim] f32 (bind_rope_table), out
    [rows, q_dim] f32, out_sums [rows, q_dim / 32] f32. The engine rewrites the small int buffers
    between steps and replays the launches of a batch size (launch.py)."""

    def __init__(self, dev: DeviceContext, layout: PagedKVLayout, n_heads: int):
        if n_heads % layout.n_kv_heads:
            raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {layout.n_kv_heads}")
        self.layout, self.n_heads, self._dev = layout, n_heads, dev
        self.group = n_heads // layout.n_kv_heads
        self.q_dim, self.kv_dim = n_heads * layout.head_dim, layout.n_kv_heads * layout.head_dim
        self.program = dev.build("paged_attention.cl", {
            "HEAD_DIM": layout.head_dim, "GROUP": self.group, "Q_DIM": self.q_dim, "KV_DIM": self.kv_dim,
            "BLOCK_SIZE": layout.block_size})

    def bind_rope_table(self, max_pos: int, inv_freq: cl.Buffer, rope_cs: cl.Buffer) -> Launch:
        """cos | sin of the RoPE angles of positions [0, max_pos) into rope_cs [max_pos, head_dim], from
        inv_freq [head_dim / 2]: run once at start-up."""
        return bind(self.program, "rope_table", (max_pos, self.layout.head_dim // 2), inv_freq, rope_cs)

    def _rows(self, n_rows: int) -> int:
        if n_rows < 1:
            raise ValueError(f"need at least one row, got {n_rows}")
        return n_rows

    def bind_kv_write(self, n_rows: int, src: cl.Buffer, src_base: int, row_stride: int, kv_stride: int,
                      head_stride: int, seq_of_row: cl.Buffer, pos: cl.Buffer, block_tables: cl.Buffer,
                      max_blocks: int, pool: cl.Buffer, layer: int) -> Launch:
        """Rows of roped K and V from `src` (strides in floats, see paged_kv_write) into the pool."""
        return bind(self.program, "paged_kv_write", (self._rows(n_rows), self.layout.n_kv_heads), src,
                    np.int64(src_base), np.int64(row_stride), np.int64(kv_stride), np.int64(head_stride),
                    seq_of_row, pos, block_tables, np.int32(max_blocks), pool,
                    np.int64(self.layout.layer_base(layer)), local_size=(1, 1))

    def bind_qkv_write(self, n_rows: int, qkv: cl.Buffer, seq_of_row: cl.Buffer, pos: cl.Buffer,
                       block_tables: cl.Buffer, max_blocks: int, pool: cl.Buffer, layer: int) -> Launch:
        """bind_kv_write for q|k|v rows whose K is already roped."""
        hd = self.layout.head_dim
        return self.bind_kv_write(n_rows, qkv, self.q_dim, self.q_dim + 2 * self.kv_dim, self.kv_dim, hd,
                                  seq_of_row, pos, block_tables, max_blocks, pool, layer)

    def bind_rope_store(self, n_rows: int, qkv: cl.Buffer, seq_of_row: cl.Buffer, pos: cl.Buffer,
                        rope_cs: cl.Buffer, block_tables: cl.Buffer, max_blocks: int, pool: cl.Buffer,
                        layer: int) -> Launch:
        """RoPE of q and k in place in qkv, and K, V into the pool (before bind_attention)."""
        return bind(self.program, "paged_rope_store_kv",
                    (self._rows(n_rows), self.layout.n_kv_heads * (self.group + 1)), qkv, seq_of_row, pos, rope_cs,
                    block_tables, np.int32(max_blocks), pool, np.int64(self.layout.layer_base(layer)),
                    local_size=(1, 1))

    def bind_attention(self, n_rows: int, qkv: cl.Buffer, seq_of_row: cl.Buffer, pos: cl.Buffer,
                       block_tables: cl.Buffer, max_blocks: int, pool: cl.Buffer, layer: int, out: cl.Buffer,
                       out_sums: cl.Buffer, scores: bool | None = None) -> Launch:
        """Causal attention of roped query rows over [0, pos[r]] of their sequences (prefill chunks):
        paged_attention_scores where `scores_fit` says it may run, else paged_attention (the same bits).
        scores: True or False to ask for one of them (a test's comparison), None to let scores_fit choose."""
        program, name, size = self._kernel("paged_attention", max_blocks, scores)
        return bind(program, name, (self._rows(n_rows), size), qkv, seq_of_row, pos, block_tables,
                    np.int32(max_blocks), pool, np.int64(self.layout.layer_base(layer)),
                    np.float32(1.0 / np.sqrt(self.layout.head_dim)), out, out_sums, local_size=(1, 1))

    def scores_fit(self, max_blocks: int) -> bool:
        """Whether paged_attention_scores serves a pool of tables of `max_blocks`: a CPU device (whose
        local memory is its caches; on a GPU or FPGA it is a small scratchpad) with room for a kv head's
        scores of the longest context in half its local memory, and the 16-wide tiles it assumes."""
        lay, device = self.layout, self._dev.device
        scores_bytes = self.group * scores_positions(max_blocks * lay.block_size) * FLOAT_BYTES
        return (bool(device.type & cl.device_type.CPU) and lay.head_dim % 16 == 0 and lay.block_size % 16 == 0
                and scores_bytes <= device.local_mem_size // 2)

    def _kernel(self, portable: str, max_blocks: int, scores: bool | None) -> tuple[cl.Program, str, int]:
        """(program, kernel, work-items per row): `portable`'s `_scores` twin (one work-item per kv head)
        where `scores_fit` says it may run, or where `scores` asks for it, else `portable` (one per query head)."""
        if self.scores_fit(max_blocks) if scores is None else scores:
            return self._scores_program(max_blocks), f"{portable}_scores", self.layout.n_kv_heads
        return self.program, portable, self.n_heads

    def _scores_program(self, max_blocks: int) -> cl.Program:
        return self._dev.build("paged_attention.cl", {
            "HEAD_DIM": self.layout.head_dim, "GROUP": self.group, "Q_DIM": self.q_dim, "KV_DIM": self.kv_dim,
            "BLOCK_SIZE": self.layout.block_size, "MAX_POS": scores_positions(max_blocks * self.layout.block_size)})

    def bind_decode(self, n_rows: int, qkv: cl.Buffer, seq_of_row: cl.Buffer, pos: cl.Buffer, rope_cs: cl.Buffer,
                    block_tables: cl.Buffer, max_blocks: int, pool: cl.Buffer, layer: int, out: cl.Buffer,
                    out_sums: cl.Buffer, scores: bool | None = None) -> Launch:
        """A decode step's RoPE, KV write and attention, one row per sequence, in one launch:
        paged_rope_attention_decode_scores where `scores_fit` says it may run, else
        paged_rope_attention_decode (the same bits); `scores` as bind_attention's."""
        program, name, size = self._kernel("paged_rope_attention_decode", max_blocks, scores)
        return bind(program, name, (self._rows(n_rows), size), qkv,
                    seq_of_row, pos, rope_cs, block_tables, np.int32(max_blocks), pool,
                    np.int64(self.layout.layer_base(layer)), np.float32(1.0 / np.sqrt(self.layout.head_dim)), out,
                    out_sums, local_size=(1, 1))


# ---- numpy reference ------------------------------------------------------------------------

def kv_write_ref(pool: np.ndarray, layer: int, k_rows: np.ndarray, v_rows: np.ndarray, seq_of_row: np.ndarray,
                 pos: np.ndarray, tables: Sequence[Sequence[int]]) -> None:
    """pool: the host image [n_layers, num_blocks, 2, n_kv, block_size, head_dim]; k_rows, v_rows:
    [rows, n_kv, head_dim]. Writes row r at pos[r] of sequence seq_of_row[r] through its table."""
    block_size = pool.shape[4]
    for r, (s, p) in enumerate(zip(seq_of_row.tolist(), pos.tolist())):
        block, slot = tables[s][p // block_size], p % block_size
        pool[layer, block, 0, :, slot] = k_rows[r]
        pool[layer, block, 1, :, slot] = v_rows[r]


def gather_kv(pool: np.ndarray, layer: int, table: Sequence[int], n: int) -> np.ndarray:
    """Positions [0, n) of one sequence, contiguous: [2, n_kv, n, head_dim]."""
    block_size = pool.shape[4]
    t = np.arange(n)
    return pool[layer, np.asarray(table)[t // block_size], :, :, t % block_size].transpose(1, 2, 0, 3)


def attention_ref(q: np.ndarray, seq_of_row: np.ndarray, pos: np.ndarray, pool: np.ndarray, layer: int,
                  tables: Sequence[Sequence[int]]) -> np.ndarray:
    """float64 softmax attention of roped queries q [rows, n_heads, head_dim] over positions
    [0, pos[r]] of their sequences in the pool image; GQA: head h reads kv head h // group.
    Returns [rows, n_heads, head_dim]."""
    n_heads, head_dim, n_kv = q.shape[1], q.shape[2], pool.shape[3]
    out = np.empty(q.shape, np.float64)
    for r, (s, p) in enumerate(zip(seq_of_row.tolist(), pos.tolist())):
        kv = gather_kv(pool, layer, tables[s], p + 1).astype(np.float64)
        for h in range(n_heads):
            k, v = kv[0, h // (n_heads // n_kv)], kv[1, h // (n_heads // n_kv)]
            scores = k @ q[r, h].astype(np.float64) / np.sqrt(head_dim)
            w = np.exp(scores - scores.max())
            out[r, h] = (w / w.sum()) @ v
    return out


def rope_ref(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """HF's rotate-half RoPE of x [rows, heads, head_dim] at pos [rows], float64, with the angles
    taken in float32 as the rope table computes them."""
    half = x.shape[-1] // 2
    ang = (pos.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)[:, None, :]
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([a * c - b * s, b * c + a * s], -1)
