"""Fixed-shape engine steps, captured as CUDA graphs and replayed: the torch engine on CUDA.

Why: eager PyTorch launches ~40 kernels per layer from Python. On a lent H100 a decode step of
the 135M model took 29 ms, nearly all of it the CPU launching kernels, for well under a
millisecond of GPU work. A graph replays a whole step's kernels with one call.

Two kinds of step have a fixed shape once padded to a bucket:
* a decode-only step: R rows (the batch size rounded up to a power of two, at least
  min_gemm_rows: 1 on CUDA), each attending over its own context gathered through its block table and
  padded to L positions (the longest context rounded up to a power of two);
* one prefill chunk alone: R rows (its length rounded up) over a context of L positions.
What varies from step to step sits in one small static input tensor the host fills with one
copy: token ids, positions, which rows are real, and block tables. Slots, the write targets, the
causal mask and the attention bias are computed from them on the device, inside the graph.
Padding rows and padded table entries point at the pool's scratch block (kv_pool.py), so their
K/V writes land where no sequence reads, and every position a padded row may read is finite
(the pool is zeroed on CUDA).

Other steps (decodes and prefill chunks mixed in one step, a step with a layer-export hook for
the hybrid hand-off, a batch past the largest bucket, a chunk that wants every row's logits: speculative
verify chunks and prompt logprobs) run eagerly through plan_step/run_step. (Until 2026-11-30 a lone verify
chunk took the prefill-chunk graph, which gives the last row's logits only: on CUDA, drafts then skipped
tokens. A lent H200's run showed it; test_cuda_graphs.py holds the fixed-shape path to the eager tokens.)

`StaticStep.forward` is plain torch: on the CPU the tests run it eagerly against the planned
eager step (same logits, same KV, nothing written outside the scratch block); on CUDA it is what
gets captured.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from services.prefill_gpu.batched_step import (ATTN_LEN_MULTIPLE, PrefillRows, StepPlan, forward_logits,
                                               min_gemm_rows, sampled)
from services.prefill_gpu.kv_pool import PagedKVPool
from services.prefill_gpu.model import LlamaTorch

if TYPE_CHECKING:
    from services.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

DECODE, CHUNK = "decode", "chunk"
MIN_CHUNK_ROWS = 16
MIN_CONTEXT = 64


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def _context_bucket(n: int, block_size: int) -> int:
    """n positions rounded up to a power of two, then to whole blocks and whole attention lanes."""
    length = _pow2_at_least(n, MIN_CONTEXT)
    for multiple in (block_size, ATTN_LEN_MULTIPLE):
        length = -(-length // multiple) * multiple
    return length


@dataclass(frozen=True)
class Bucket:
    kind: str  # DECODE or CHUNK
    rows: int  # R
    context: int  # L, a multiple of the block size and of ATTN_LEN_MULTIPLE

    def sequences(self) -> int:
        return self.rows if self.kind == DECODE else 1


class StaticStep:
    """One bucket's input buffer and its forward over them; captured as a graph on CUDA.

    Input layout (int64, one tensor so one host-to-device copy fills it):
    [tokens R | positions R | real R (0/1) | tables S x NB], NB = L // block_size.
    """

    def __init__(self, model: LlamaTorch, pool: PagedKVPool, bucket: Bucket):
        self.model, self.pool, self.bucket = model, pool, bucket
        r, s = bucket.rows, bucket.sequences()
        self.n_table = bucket.context // pool.block_size
        self.size = 3 * r + s * self.n_table
        dev = pool.device
        self.inputs = torch.zeros(self.size, dtype=torch.int64, device=dev)
        # the host side: pinned on CUDA so the copy is one asynchronous DMA
        self.host = torch.zeros(self.size, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.host_np = self.host.numpy()
        self._row_ids = torch.arange(r, device=dev)
        self._ctx_pos = torch.arange(bucket.context, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.fill_padding()

    # ---- host side ---------------------------------------------------------------------------
    def fill_padding(self) -> None:
        """Every row padding, every table entry the scratch block: a step that touches nothing real."""
        r = self.bucket.rows
        self.host_np[:3 * r] = 0
        self.host_np[3 * r:] = self.pool.scratch_block

    def fill(self, chunks: Sequence["ScheduledChunk"]) -> None:
        """The chunks' tokens, positions and tables into the host buffer (validated by the caller)."""
        r, nb = self.bucket.rows, self.n_table
        h = self.host_np
        self.fill_padding()
        tokens, positions, real = h[:r], h[r:2 * r], h[2 * r:3 * r]
        tables = h[3 * r:].reshape(self.bucket.sequences(), nb)
        if self.bucket.kind == DECODE:
            for i, c in enumerate(chunks):
                tokens[i] = c.token_ids[0]
                positions[i] = c.start
                real[i] = 1
                t = c.block_table[:nb]
                tables[i, :len(t)] = t
        else:
            (c,) = chunks
            n = len(c.token_ids)
            tokens[:n] = c.token_ids
            positions[:] = np.arange(c.start, c.start + r)  # padding rows too: their mask stays causal
            real[:n] = 1
            t = c.block_table[:nb]
            tables[0, :len(t)] = t
        self.inputs.copy_(self.host, non_blocking=True)

    # ---- device side -------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """The step as a StepPlan computed on the device from the input buffer (no host sync)."""
        b, pool, cfg = self.bucket, self.pool, self.model.cfg
        r, bs = b.rows, pool.block_size
        inp = self.inputs
        tokens, positions, real = inp[:r], inp[r:2 * r], inp[2 * r:3 * r].bool()
        tables = inp[3 * r:].view(b.sequences(), self.n_table)
        row_table = tables if b.kind == DECODE else tables.expand(r, self.n_table)
        block = row_table.gather(1, (positions // bs).clamp(max=self.n_table - 1)[:, None])[:, 0]
        scratch = pool.scratch_block * bs + self._row_ids % bs
        write = torch.where(real, block * bs + positions % bs, scratch)
        ctx = tables[:, self._ctx_pos // bs] * bs + self._ctx_pos % bs  # [S, L] slots of every position
        visible = self._ctx_pos[None, :] <= positions[:, None]  # [R, L]: causal, through each row's position
        if b.kind == DECODE:
            bias = torch.zeros(visible.shape, dtype=pool.dtype, device=inp.device).masked_fill_(~visible,
                                                                                                   float("-inf"))
            return StepPlan(r, tokens, positions, write, self._row_ids, ctx,
                            bias.repeat(cfg.n_kv_heads, 1)[:, None, :], [], self._row_ids, decode_only=True,
                            min_rows=min_gemm_rows(pool.device))
        last = (real.sum() - 1).clamp(min=0).reshape(1)  # the chunk's last real row (0 in a padding-only step)
        return StepPlan(r, tokens, positions, write, None, None, None,
                        [PrefillRows(0, r, 0, ctx[0], visible)], last, min_rows=min_gemm_rows(pool.device))

    def forward(self) -> torch.Tensor:
        return forward_logits(self.model, self.pool, self.plan())

    def capture(self, mempool) -> None:
        """Record the forward as a CUDA graph (on padding inputs: the capture writes only scratch)."""
        self.fill_padding()
        self.inputs.copy_(self.host)
        side = torch.cuda.Stream(self.pool.device)
        side.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: cuBLAS handles and workspaces exist before capture
                self.forward()
        torch.cuda.current_stream(self.pool.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a gRPC handler's) must not void this capture
        with torch.cuda.graph(self.graph, pool=mempool, capture_error_mode="thread_local"):
            self.logits = self.forward()

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.logits


class StepGraphs:
    """The engine's fixed-shape steps by bucket, captured on first use (CUDA) or run eagerly (tests)."""

    def __init__(self, model: LlamaTorch, pool: PagedKVPool, max_rows: int, max_seqs: int, max_context: int,
                 capture: bool | None = None):
        self.model, self.pool = model, pool
        self.capture = pool.device.type == "cuda" if capture is None else capture
        self.max_rows = max_rows
        self.min_decode_rows = min_gemm_rows(pool.device)
        self.max_decode_rows = _pow2_at_least(max_seqs, self.min_decode_rows)
        self.max_chunk_rows = _pow2_at_least(max_rows, MIN_CHUNK_ROWS)
        self.max_context = _context_bucket(max_context, pool.block_size)
        self.steps: dict[Bucket, StaticStep] = {}
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = {DECODE: 0, CHUNK: 0}
        self.capture_s = 0.0

    def bucket_for(self, chunks: Sequence["ScheduledChunk"]) -> Bucket | None:
        """The bucket these chunks fit, or None (a mixed step, too many rows, too long a context, or a chunk
        that wants every row's logits: a verify chunk's drafts or prompt logprobs, where the graphs give a
        chunk's last row only)."""
        if not chunks or any(c.all_logits for c in chunks):
            return None
        if all(len(c.token_ids) == 1 for c in chunks):
            rows = _pow2_at_least(len(chunks), self.min_decode_rows)
            context = _context_bucket(max(c.start + 1 for c in chunks), self.pool.block_size)
            if rows > self.max_decode_rows or context > self.max_context:
                return None
            return Bucket(DECODE, rows, context)
        if len(chunks) == 1:
            (c,) = chunks
            n = len(c.token_ids)
            rows = _pow2_at_least(n, MIN_CHUNK_ROWS)
            context = _context_bucket(c.start + rows, self.pool.block_size)
            if rows > self.max_chunk_rows or context > self.max_context:
                return None
            return Bucket(CHUNK, rows, context)
        return None

    def validate(self, chunks: Sequence["ScheduledChunk"]) -> None:
        """What plan_step checks, without building its per-position arrays: ValueError when out of bounds."""
        n_rows = sum(len(c.token_ids) for c in chunks)
        if n_rows > self.max_rows:
            raise ValueError(f"{n_rows} rows exceed max_num_batched_tokens={self.max_rows}")
        bs, n_blocks, vocab = self.pool.block_size, self.pool.num_blocks, self.model.cfg.vocab_size
        for c in chunks:
            n = len(c.token_ids)
            if n == 0:
                raise ValueError(f"chunk of sequence {c.seq_id} has no tokens")
            if c.start < 0:
                raise ValueError(f"empty or negative position range [{c.start}, {c.start + n})")
            need = -(-(c.start + n) // bs)
            if need > len(c.block_table):
                raise ValueError(f"position {c.start + n - 1} is past the block table "
                                 f"({len(c.block_table)} blocks of {bs})")
            table = c.block_table[:need]
            if min(table) < 0 or max(table) >= n_blocks:
                raise ValueError(f"block ids must be in [0, {n_blocks}), got {list(table)}")
            if min(c.token_ids) < 0 or max(c.token_ids) >= vocab:
                raise ValueError(f"token ids must be in [0, {vocab})")

    @torch.inference_mode()
    def step(self, chunks: Sequence["ScheduledChunk"], greedy: bool) -> list[int] | np.ndarray | None:
        """The step through its bucket's graph; None when it has no bucket (the caller runs it eagerly)."""
        bucket = self.bucket_for(chunks)
        if bucket is None:
            return None
        self.validate(chunks)
        static = self.steps.get(bucket)
        if static is None:
            static = self.steps[bucket] = StaticStep(self.model, self.pool, bucket)
            if self.capture:
                t = time.perf_counter()
                static.capture(self.mempool)
                dt = time.perf_counter() - t
                self.capture_s += dt
                log.info("captured a CUDA graph for %s steps of %d rows over %d positions in %.0f ms (%d graphs)",
                         bucket.kind, bucket.rows, bucket.context, dt * 1e3, len(self.steps))
        static.fill(chunks)
        logits = static.run()
        self.replays[bucket.kind] += 1
        if bucket.kind == DECODE:
            rows = [i for i, c in enumerate(chunks) if c.samples]
            out = logits[:len(chunks)] if len(rows) == len(chunks) else logits[rows]
        else:
            out = logits if chunks[0].samples else logits[:0]
        return sampled(out, greedy)
