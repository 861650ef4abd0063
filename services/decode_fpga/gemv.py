"""Weight matrices resident on the OpenCL device, and the GEMV that reads them.

`DeviceMatrix` is the seam between the launch plans and a storage format: the
plans only bind GEMV and embedding launches (`bind_gemv`, `bind_embed`, and the
fused one-row GEMVs where a matrix says it offers them), so a quantized format
drops in beside fp32 and fp16.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import pyopencl as cl

from services.decode_fpga.device import DeviceContext
from services.decode_fpga.launch import Launch, RowLaunch, bind, bind_rows

DENSE_FORMATS = {"fp32": (np.float32, 0), "fp16": (np.float16, 1)}


class DeviceMatrix(Protocol):
    rows: int
    cols: int
    nbytes: int
    fmt: str

    needs_block_sums: bool  # bind_gemv reads x_sums, the sums of x over 32-column blocks
    fuses_norm: bool  # bind_gemv_norm is offered: one row's RMSNorm in the GEMV's prologue
    fuses_silu: bool  # bind_gemv_silu is offered: one row's silu(gate) * up in the GEMV's prologue

    def bind_gemv(self, x: cl.Buffer, y: cl.Buffer, batch: int, accumulate: bool = False,
                  x_sums: cl.Buffer | None = None) -> Launch:
        """The launch of y[b, r] (+)= sum_c W[r, c] * x[b, c] for b < batch. x: [batch, cols] float32
        row-major, y: [batch, rows] float32 row-major, x_sums: [batch, cols / 32] float32."""

    def bind_gemv_rows(self, x: cl.Buffer, y: cl.Buffer, n_rows: cl.Buffer, accumulate: bool = False,
                       x_sums: cl.Buffer | None = None) -> RowLaunch:
        """bind_gemv for any number of rows, each computed as one row alone would be (batch invariance):
        the row count is n_rows[0] on the device, or the RowLaunch's rows when it spans them."""

    def bind_embed(self, tokens: cl.Buffer, x: cl.Buffer, n_rows: int) -> Launch:
        """The launch of x[r, :] = W[tokens[r], :] for r < n_rows: the embedding lookup."""

    def enqueue_gemv(self, queue: cl.CommandQueue, x: cl.Buffer, y: cl.Buffer, batch: int,
                     accumulate: bool = False) -> None:
        """bind_gemv(...) enqueued once: for tests and one-off use, never wait."""


class EnqueueOnce:
    """enqueue_gemv / enqueue_embed from a matrix's bind_gemv / bind_embed: one launch, bound and
    enqueued, for tests and one-off use (the engine binds once and replays)."""

    def enqueue_gemv(self, queue: cl.CommandQueue, x: cl.Buffer, y: cl.Buffer, batch: int,
                     accumulate: bool = False) -> None:
        self.bind_gemv(x, y, batch, accumulate).enqueue(queue)

    def enqueue_embed(self, queue: cl.CommandQueue, tokens: cl.Buffer, x: cl.Buffer, n_rows: int) -> None:
        self.bind_embed(tokens, x, n_rows).enqueue(queue)


class DenseMatrix(EnqueueOnce):
    """A [rows, cols] matrix stored as fp32 or fp16 in one device buffer."""

    needs_block_sums = False
    fuses_norm = False
    fuses_silu = False

    def __init__(self, dev: DeviceContext, w: np.ndarray, fmt: str):
        if fmt not in DENSE_FORMATS:
            raise ValueError(f"dense format must be one of {sorted(DENSE_FORMATS)}, got {fmt!r}")
        if w.ndim != 2 or w.shape[1] % 16:
            raise ValueError(f"matrix of shape {w.shape}: need 2-D with cols % 16 == 0")
        dtype, code = DENSE_FORMATS[fmt]
        host = np.ascontiguousarray(w, dtype=dtype)
        self.rows, self.cols = host.shape
        self.nbytes, self.fmt = host.nbytes, fmt
        self.buffer = cl.Buffer(dev.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)
        self._program = dev.build("gemv.cl", {"WFMT": code})

    def bind_gemv(self, x, y, batch, accumulate=False, x_sums=None) -> Launch:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        return bind(self._program, "gemv", (self.rows,), self.buffer, x, y, np.int32(self.cols),
                    np.int32(self.rows), np.int32(batch), np.int32(bool(accumulate)), by_row=True)

    def bind_gemv_rows(self, x, y, n_rows, accumulate=False, x_sums=None) -> RowLaunch:
        return bind_rows(self._program, "gemv_rows", (self.rows,), self.buffer, x, y, np.int32(self.cols),
                         np.int32(self.rows), n_rows, np.int32(bool(accumulate)), rows_dim=None, by_row=True)

    def bind_embed(self, tokens: cl.Buffer, x: cl.Buffer, n_rows: int) -> Launch:
        """x[r, :] = this[tokens[r], :], for the embedding (which is also the tied LM head)."""
        return bind(self._program, "embed_rows", (n_rows,), self.buffer, tokens, x, np.int32(self.cols),
                    by_row=True)


def upload_dense_matrix(dev: DeviceContext, w: np.ndarray, fmt: str) -> DenseMatrix:
    return DenseMatrix(dev, w, fmt)
