"""One engine step over the paged pool: every scheduled chunk's rows in one forward (BatchEngine.step).

All rows of all chunks go through one embedding lookup and one matmul per weight matrix per
layer; RoPE at each row's own position; every row's K/V is written into its slot with one
`index_copy_` per layer. Attention: the one-token chunks (decodes) together, their contexts
gathered through their block tables into one padded batch with a mask; each longer chunk (a
prefill) in its own SDPA call, causal over [its cached context + itself]. Logits only for the
sampling rows.

Batch invariance (a row's result does not depend on the other rows) rests on the BLAS giving a row
of x @ W the same bits at every row count from some floor up, whatever the other rows hold. The
engine checks that on its own matrices at start (cpu_matmul.py) and every matmul here gets at
least that many rows (`min_rows`: zero rows pad the batch); tests check the property itself
(tests/prefill_gpu/test_batched_step.py). MKL in its default mode kept it from 4 rows on an AMD
EPYC (rows 1..3 take another kernel) and not at all on an Intel Xeon (K 1536: rows changed at
M = 24-128), so the service puts MKL in strict reproducibility mode first, where the Xeon kept it
from one row. The padding to 4 was a measured choice (a benchmark retired in facdb2a; docs/benchmarks.md):
no other way of computing one row that torch offers in MKL's default mode gives the bits that row
gets among 4+ rows (x @ W at M = 1, torch.mv, (W^T @ x^T)^T, MKL's packed linear: all differ), and
the one invariant alternative, a gemv per row at every batch size, reads every weight once per
row, which a batch of 16 decodes cannot afford. With a floor of 4 a lone decode pays for three
zero rows (measured at one torch thread on the EPYC: 76 ms padded against 46 ms unpadded, 1.65x,
gpu_padding_1thread.json).
On CUDA nothing is padded (min_gemm_rows): cuBLAS picks kernels by shape at any row count.
Decode attention pads every context to
a multiple of ATTN_LEN_MULTIPLE: masked positions past that add exact zeros, so a row attends
bit-identically whatever the batch's longest context; its batched matmuls read contiguous K/V
(with strided operands a row's bits changed with the number of rows). Measured on the CPU only:
cuBLAS picks kernels by shape, so on CUDA rows agree to rounding, not to the bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from services.prefill_gpu.kv_pool import PagedKVPool
from services.prefill_gpu.model import LlamaTorch

if TYPE_CHECKING:
    from services.engine.scheduler import ScheduledChunk

MIN_GEMM_ROWS = 4  # MKL's default mode: below this it switches kernels and a row's bits depend on the row count


def min_gemm_rows(device: torch.device) -> int:
    """Rows every matmul gets at least when the engine has not measured its floor (cpu_matmul.py):
    MIN_GEMM_ROWS on the CPU; 1 on CUDA, where cuBLAS picks its kernel by shape at every row count,
    so padding buys no invariance, and a one-row product is up to 3x faster than four rows (H100:
    bench/results/engine_gpu.json, gemm_us)."""
    return 1 if device.type == "cuda" else MIN_GEMM_ROWS
ATTN_LEN_MULTIPLE = 16  # one AVX512 register of fp32: padded lengths keep each lane's sum order


@dataclass
class PrefillRows:
    """One multi-token chunk: rows [row0, row1) of the step, positions [start, start + n)."""

    row0: int
    row1: int
    start: int
    context_slots: torch.Tensor  # [start + n]: slots of positions 0 .. start + n - 1
    mask: torch.Tensor | None  # [n, start + n] bool, True = may attend; None: plain causal (start 0)


@dataclass
class StepPlan:
    """A validated step as index tensors on the device, shared by every layer."""

    n_rows: int  # real rows; the tensors below hold n_padded >= n_rows
    token_ids: torch.Tensor  # [n_padded]
    positions: torch.Tensor  # [n_padded]
    write_slots: torch.Tensor  # [n_rows]
    decode_rows: torch.Tensor | None  # [B] rows of the one-token chunks
    decode_slots: torch.Tensor | None  # [B, L]: slots of each decode row's context, padded
    decode_bias: torch.Tensor | None  # [kv_heads * B, 1, L]: 0 at a real position, -inf at padding
    prefills: list[PrefillRows]
    sample_rows: torch.Tensor  # [S]: each sampling chunk's last row (an all_logits chunk's every row), in order
    # every row, padding included, is a decode row and decode_rows is 0 .. n_padded - 1 (a captured
    # decode step): attention reads q and gives its output in row order, with no gather or scatter
    decode_only: bool = False
    min_rows: int = MIN_GEMM_ROWS  # rows every matmul gets at least (n_padded >= this)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_step(chunks: Sequence["ScheduledChunk"], pool: PagedKVPool, max_rows: int, vocab_size: int,
              min_rows: int | None = None) -> StepPlan:
    """Check the chunks and turn them into index tensors; ValueError on anything out of bounds.
    `min_rows`: the engine's row floor (None: min_gemm_rows of the pool's device)."""
    min_rows = min_gemm_rows(pool.device) if min_rows is None else min_rows
    n_rows = sum(len(c.token_ids) for c in chunks)
    if n_rows > max_rows:
        raise ValueError(f"{n_rows} rows exceed max_num_batched_tokens={max_rows}")
    token_ids, positions, write_slots, sample_rows = [], [], [], []
    decode_rows, decode_contexts, prefills = [], [], []
    row = 0
    for c in chunks:
        n = len(c.token_ids)
        if n == 0:
            raise ValueError(f"chunk of sequence {c.seq_id} has no tokens")
        slots = pool.slots(c.block_table, c.start, c.start + n)  # validates positions and block ids
        token_ids.extend(c.token_ids)
        positions.append(np.arange(c.start, c.start + n, dtype=np.int64))
        write_slots.append(slots)
        if n == 1:
            decode_rows.append(row)
            decode_contexts.append(pool.slots(c.block_table, 0, c.start + 1))
        else:
            context = pool.slots(c.block_table, 0, c.start + n)
            mask = None
            if c.start:  # bottom-right causal: row i sees positions 0 .. start + i
                allowed = np.arange(c.start + n)[None, :] <= (c.start + np.arange(n))[:, None]
                mask = pool.index(allowed)
            prefills.append(PrefillRows(row, row + n, c.start, pool.index(context), mask))
        row += n
        if getattr(c, "all_logits", False):  # prompt logprobs: every row's logits, the last one samples
            sample_rows.extend(range(row - n, row))
        elif c.samples:
            sample_rows.append(row - 1)
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    n_padded = max(n_rows, min_rows)
    ids = np.pad(ids, (0, n_padded - n_rows))
    pos = np.pad(np.concatenate(positions) if positions else np.zeros(0, np.int64), (0, n_padded - n_rows))
    plan = StepPlan(n_rows, pool.index(ids), pool.index(pos),
                    pool.index(np.concatenate(write_slots) if write_slots else np.zeros(0, np.int64)),
                    None, None, None, prefills, pool.index(np.asarray(sample_rows, dtype=np.int64)),
                    min_rows=min_rows)
    if decode_rows:
        length = _round_up(max(len(s) for s in decode_contexts), ATTN_LEN_MULTIPLE)
        gather = np.zeros((len(decode_rows), length), dtype=np.int64)  # padding reads slot 0, masked out
        real = np.zeros((len(decode_rows), length), dtype=bool)
        for b, s in enumerate(decode_contexts):
            gather[b, :len(s)] = s
            real[b, :len(s)] = True
        plan.decode_rows = pool.index(np.asarray(decode_rows, dtype=np.int64))
        plan.decode_slots = pool.index(gather)
        bias = np.where(real, np.float32(0), np.float32(-np.inf))  # [B, L]
        kv_heads = pool.cfg.n_kv_heads  # rows ordered (kv head, decode row) as _decode_attention's
        plan.decode_bias = pool.index(np.tile(bias, (kv_heads, 1))[:, None, :]).to(pool.dtype)
    return plan


def _decode_attention(model: LlamaTorch, pool: PagedKVPool, layer: int, plan: StepPlan,
                      q: torch.Tensor) -> torch.Tensor:
    """Attention of every one-token row over its gathered context; [B, q_dim]."""
    c = model.cfg
    b, length = plan.decode_slots.shape
    group = c.n_heads // c.n_kv_heads
    # [2, kvh, B * L, dim], contiguous: with strided operands torch's batched matmul changes a row's bits with B
    k, v = pool.gather(layer, plan.decode_slots).view(2, c.n_kv_heads * b, length, c.head_dim)
    # query head h reads kv head h // group (as SDPA's enable_gqa): [kvh * B, group, dim]
    rows = q if plan.decode_only else q.index_select(0, plan.decode_rows)
    qg = rows.view(b, c.n_kv_heads, group, c.head_dim).transpose(0, 1)
    qg = qg.reshape(c.n_kv_heads * b, group, c.head_dim)
    # scale, mask and q @ k^T in one call: [kvh * B, group, L]
    scores = torch.baddbmm(plan.decode_bias, qg, k.transpose(1, 2), alpha=c.head_dim ** -0.5)
    out = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype) @ v  # [kvh * B, group, dim]
    return out.view(c.n_kv_heads, b, group, c.head_dim).transpose(0, 1).reshape(b, c.q_dim)


def _prefill_attention(pool: PagedKVPool, layer: int, chunk: PrefillRows, q: torch.Tensor) -> torch.Tensor:
    """One chunk's causal attention over its cached context and itself; [n, q_dim]."""
    k, v = pool.gather(layer, chunk.context_slots)[:, None]  # [1, kvh, ctx, dim] each
    qc = q[chunk.row0:chunk.row1].transpose(0, 1)[None]  # [1, heads, n, dim]
    if chunk.mask is None:
        out = F.scaled_dot_product_attention(qc, k, v, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(qc, k, v, attn_mask=chunk.mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(chunk.row1 - chunk.row0, -1)


@torch.inference_mode()
def forward_logits(model: LlamaTorch, pool: PagedKVPool, plan: StepPlan,
                   on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
    """The forward of a planned step: float32 logits of the sampling rows, [S, vocab], on the device.

    No host synchronisation happens in here (CUDA graphs capture it as it is: cuda_graphs.py)."""
    c, n = model.cfg, plan.n_rows
    rope = model._rope_tables(plan.positions)
    x = model._embed(plan.token_ids, plan.positions)  # [n_padded, hidden]
    if not plan.decode_only:
        attn = torch.zeros((x.shape[0], c.q_dim), device=x.device, dtype=x.dtype)  # padding rows stay 0
    for li, layer in enumerate(model.layers):
        q, k, v = model._qkv(layer, x, rope)  # q [n_padded, heads, dim]; k, v [n_padded, kv_heads, dim]
        pool.write(li, plan.write_slots, k[:n], v[:n])
        if plan.decode_only:
            attn = _decode_attention(model, pool, li, plan, q)
        elif plan.decode_rows is not None:
            attn.index_copy_(0, plan.decode_rows, _decode_attention(model, pool, li, plan, q))
        for chunk in plan.prefills:
            attn[chunk.row0:chunk.row1] = _prefill_attention(pool, li, chunk, q)
        x = model._mlp_residual(layer, x, attn)
        if on_layer is not None:
            on_layer(li)
    n_sample = plan.sample_rows.shape[0]
    if n_sample == 0:
        return x.new_zeros((0, c.vocab_size), dtype=torch.float32)
    rows = x.index_select(0, plan.sample_rows)
    floor = plan.min_rows
    if n_sample < floor:  # the LM head's matmul too keeps its row bits whatever S is
        rows = torch.cat([rows, rows.new_zeros((floor - n_sample, rows.shape[1]))])
    return model._logits(rows)[:n_sample]  # [S, vocab] float32


def sampled(logits: torch.Tensor, greedy: bool) -> list[int] | np.ndarray:
    """What a step returns: greedy, each row's argmax; else the float32 logits [S, vocab] on the host."""
    if greedy:
        return logits.argmax(dim=-1).tolist()
    return logits.cpu().numpy()


@torch.inference_mode()
def run_step(model: LlamaTorch, pool: PagedKVPool, plan: StepPlan, greedy: bool,
             on_layer: Callable[[int], None] | None = None) -> list[int] | np.ndarray:
    """The forward of a planned step; greedy: each sampling row's argmax, else float32 logits [S, vocab]."""
    return sampled(forward_logits(model, pool, plan, on_layer), greedy)
