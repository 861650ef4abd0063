"""A layer matrix stacked from GGUF tensors of different block formats (a DeviceMatrix, see gemv.py).

The device computes q|k|v (and gate|up) as one matrix, so one GEMV writes the rows
attention (and the activation) read. A Q4_K_M file of a 1B-class model keeps q and
k in Q4_K and v in Q6_K in some layers (and may do the same to gate and up): no one
block format holds the stack exactly (gguf_blocks.stack_exact), and storing it as
f32 would read 7x the bytes. Here each part stays a QuantMatrix in its own format
and writes its own rows of the shared output (the kernels' y_offset, y_stride), so
a GEMV over the stack is one launch per part, each part's rows computed exactly as
a one-format stack computes them.

Such layers are not packed for the one-launch decode step (decode_layers.cl reads
one format per matrix); the engine runs their steps launch by launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyopencl as cl

from services.decode_fpga.device import DeviceContext
from services.decode_fpga.gemv import EnqueueOnce
from services.decode_fpga.quant_gemv import QuantMatrix
from services.model.gguf_blocks import BlockTensor


@dataclass(frozen=True)
class Launches:
    """Launches (or RowLaunches) enqueued one after another as one: the plans treat a stacked
    matrix's GEMV like any other's."""

    parts: tuple

    def enqueue(self, queue: cl.CommandQueue, *rows) -> None:
        for launch in self.parts:
            launch.enqueue(queue, *rows)


class StackedMatrix(EnqueueOnce):
    """[sum of the parts' rows, cols]: the parts one under the other, each in its own block format."""

    fuses_silu = False  # only q|k|v and gate|up are stacked; the down projection is one tensor

    def __init__(self, dev: DeviceContext, parts: list[BlockTensor]):
        if len({p.cols for p in parts}) != 1:
            raise ValueError(f"stacked parts need one column count: {[(p.name, p.cols) for p in parts]}")
        self.rows, self.cols = sum(p.rows for p in parts), parts[0].cols
        self.name = "|".join(p.name for p in parts)
        self.fmt = "+".join(p.qtype for p in parts)
        offsets = [sum(p.rows for p in parts[:i]) for i in range(len(parts))]
        self.parts = [QuantMatrix(dev, p, y_offset=off, y_stride=self.rows) for p, off in zip(parts, offsets)]
        self.nbytes = sum(m.nbytes for m in self.parts)

    @property
    def needs_block_sums(self) -> bool:
        return any(m.needs_block_sums for m in self.parts)

    @property
    def fuses_norm(self) -> bool:
        return all(m.fuses_norm for m in self.parts)

    def bind_gemv(self, x: cl.Buffer, y: cl.Buffer, batch: int, accumulate: bool = False,
                  x_sums: cl.Buffer | None = None) -> Launches:
        return Launches(tuple(m.bind_gemv(x, y, batch, accumulate, x_sums) for m in self.parts))

    def bind_gemv_rows(self, x: cl.Buffer, y: cl.Buffer, n_rows: cl.Buffer, accumulate: bool = False,
                       x_sums: cl.Buffer | None = None) -> Launches:
        return Launches(tuple(m.bind_gemv_rows(x, y, n_rows, accumulate, x_sums) for m in self.parts))

    def bind_gemv_norm(self, x: cl.Buffer, norm_w: cl.Buffer, eps: float, y: cl.Buffer,
                       accumulate: bool = False) -> Launches:
        """Each part normalizes x in its own prologue (the same values: norm_row.h) and writes its rows."""
        return Launches(tuple(m.bind_gemv_norm(x, norm_w, eps, y, accumulate) for m in self.parts))

    def bind_block_sums(self, x: cl.Buffer, x_sums: cl.Buffer, batch: int):
        return self.parts[0].bind_block_sums(x, x_sums, batch)

    def enqueue_gemv(self, queue: cl.CommandQueue, x: cl.Buffer, y: cl.Buffer, batch: int,
                     accumulate: bool = False) -> None:
        """One-off: the block sums once, when a part reads them (never waits)."""
        sums = None
        if self.needs_block_sums:
            sums = cl.Buffer(queue.context, cl.mem_flags.READ_WRITE, batch * (self.cols // 32) * 4)
            self.bind_block_sums(x, sums, batch).enqueue(queue)
        self.bind_gemv(x, y, batch, accumulate, sums).enqueue(queue)

    def bind_embed(self, tokens: cl.Buffer, x: cl.Buffer, n_rows: int):
        raise ValueError(f"{self.name}: a stacked layer matrix is never an embedding")
