"""The rows of a paged step (the continuous-batching path): from scheduled chunks to the ints the
kernels read, checked, and their one upload.

A step's rows are its chunks' tokens, one row per token, each with the index of its chunk
(the kernels' seq_of_row: the row of the step's block tables) and its position. Chunks of one
token (decodes, and a prompt's one-token chunk) come first, in chunk order, then the longer
chunks: a one-token chunk runs through paged_rope_attention_decode (RoPE, the KV write and
attention in one launch) and a longer one through paged_rope_store_kv + paged_attention, whose
rows other rows of their chunk read. Both give a row the same bits (the row's own position joins
its attention last in both), so a row's arithmetic depends neither on its batch nor on its chunk:
a speculative verify chunk's rows are the decode steps' rows. The sampling rows (each sampling
chunk's last row; every row of a chunk that wants all its logits, for prompt logprobs) are listed
in chunk order.

On the device every int input lives in one buffer, a section per input at an aligned origin,
bound through sub-buffers, so a step uploads them with one copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyopencl as cl

from services.decode_fpga.paged_attention import NO_BLOCK, PagedKVLayout
from services.decode_fpga.paged_kv_store import check_block_table

SECTIONS = ("n_rows", "n_samples", "tokens", "seq_of_row", "pos", "sample_rows", "block_tables")


@dataclass(frozen=True)
class StepRows:
    """One step's rows, host side. The spans (start, count) the launches cover: all rows, the
    one-token chunks' rows, the longer chunks' rows, the sampling rows (of the gathered buffer)."""

    n_rows: int
    n_decodes: int  # rows [0, n_decodes) are one-token chunks
    n_samples: int
    ints: np.ndarray  # int32: the sections' contents, as PagedStepInputs lays them out, up to the last used

    def span(self, name: str) -> tuple[int, int]:
        if name == "all":
            return 0, self.n_rows
        if name == "decodes":
            return 0, self.n_decodes
        if name == "chunks":
            return self.n_decodes, self.n_rows - self.n_decodes
        if name == "samples":
            return 0, self.n_samples
        raise ValueError(f"no span {name!r}")


class PagedStepInputs:
    """The step's int inputs on the device: counts, tokens, seq_of_row, pos, sample_rows [max_seqs] and
    block_tables [max_seqs, max_blocks], each a sub-buffer of one buffer."""

    def __init__(self, dev, layout: PagedKVLayout, vocab: int, max_rows: int, max_seqs: int, max_blocks: int,
                 max_tokens: int, max_samples: int | None = None):
        self.layout, self.vocab = layout, vocab
        self.max_samples = max_samples or max_seqs  # logit rows a step gives (prompt logprobs: more than seqs)
        self.max_rows, self.max_seqs, self.max_blocks, self.max_tokens = max_rows, max_seqs, max_blocks, max_tokens
        align = max(1, dev.device.mem_base_addr_align // 32)  # in ints (the device gives bits)
        sizes = {"n_rows": 1, "n_samples": 1, "tokens": max_rows, "seq_of_row": max_rows, "pos": max_rows,
                 "sample_rows": self.max_samples, "block_tables": max_seqs * max_blocks}
        self.offsets, at = {}, 0
        for name in SECTIONS:
            self.offsets[name] = at
            at += -(-sizes[name] // align) * align
        self._queue = dev.queue
        self._buffer = cl.Buffer(dev.context, cl.mem_flags.READ_ONLY, at * 4)
        self.buffers = {name: self._buffer.get_sub_region(self.offsets[name] * 4, sizes[name] * 4)
                        for name in SECTIONS}
        self._on_device: bytes | None = None  # what the buffer holds, to skip a repeated upload

    def rows(self, chunks: Sequence) -> StepRows:
        """The step's rows from its chunks (services.engine.scheduler.ScheduledChunk), checked: ValueError
        on a step too large, an empty chunk, a token outside the vocabulary, a position past the
        context or the chunk's block table, a block outside the pool, a sequence twice."""
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        if len(chunks) > self.max_seqs:
            raise ValueError(f"{len(chunks)} chunks in one step; the engine takes at most {self.max_seqs}")
        if len({c.seq_id for c in chunks}) != len(chunks):
            raise ValueError("a sequence has two chunks in one step")
        n = sum(len(c.token_ids) for c in chunks)
        if n > self.max_rows:
            raise ValueError(f"{n} tokens in one step; the engine takes at most {self.max_rows}")
        order = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        n_decodes = len(order)
        order += [i for i, c in enumerate(chunks) if len(c.token_ids) != 1]
        ints = np.zeros(self.offsets["block_tables"] + len(chunks) * self.max_blocks, np.int32)
        o = self.offsets
        tables = ints[o["block_tables"]:].reshape(len(chunks), self.max_blocks)
        tables[:] = NO_BLOCK
        row, last_row = 0, {}
        for k, i in enumerate(order):
            c = chunks[i]
            count, end = len(c.token_ids), c.start + len(c.token_ids)
            if count == 0 or c.start < 0:
                raise ValueError(f"chunk of sequence {c.seq_id}: {count} tokens from position {c.start}")
            tokens = np.asarray(c.token_ids, np.int64)
            if tokens.min() < 0 or tokens.max() >= self.vocab:
                raise ValueError(f"chunk of sequence {c.seq_id} has a token outside [0, {self.vocab})")
            ids = check_block_table(self.layout, c.block_table, end, self.max_tokens)
            tables[k, :len(ids)] = ids
            ints[o["tokens"] + row:o["tokens"] + row + count] = tokens
            ints[o["seq_of_row"] + row:o["seq_of_row"] + row + count] = k
            ints[o["pos"] + row:o["pos"] + row + count] = np.arange(c.start, end)
            row += count
            last_row[i] = row - 1
        samples = []  # in chunk order: a sampling chunk's last row; an all_logits chunk's every row
        for i, c in enumerate(chunks):
            if getattr(c, "all_logits", False):
                samples.extend(range(last_row[i] - len(c.token_ids) + 1, last_row[i] + 1))
            elif c.samples:
                samples.append(last_row[i])
        if len(samples) > self.max_samples:
            raise ValueError(f"{len(samples)} logit rows in one step; the engine takes at most {self.max_samples}")
        ints[o["n_rows"]], ints[o["n_samples"]] = n, len(samples)
        ints[o["sample_rows"]:o["sample_rows"] + len(samples)] = samples
        return StepRows(n, n_decodes, len(samples), ints)

    def upload(self, rows: StepRows, keep: list) -> None:
        """Enqueue the rows' ints (one copy; none when the device holds them already)."""
        key = rows.ints.tobytes()
        if key == self._on_device:
            return
        keep.append(rows.ints)
        cl.enqueue_copy(self._queue, self._buffer, rows.ints, is_blocking=False)
        self._on_device = key
