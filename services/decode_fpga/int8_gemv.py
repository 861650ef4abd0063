"""The opt-in 8-bit-activation GEMVs of the paged step (HYBRIDSERVE_DECODE_ACTIVATIONS=int8).

With `int8` activations a block matrix's paged-step GEMV (QuantMatrix.bind_gemv_rows) becomes two
launches: one quantizes the step's rows of x to int8 (once per row, shared by every output row), the
other takes integer dot products of the weights' quants with them (kernels/gemv_quant_int8.cl: AVX2's
vpmaddubsw on a CPU, cl_khr_integer_dot_product where a device offers it, else an int loop). It
changes logits, and sometimes tokens, so it is opt-in; docs/decode-kernels.md has its divergence
from the exact path.

x's layout depends on the weights' format (K_X_BLOCK):
- Q4_0, Q4_1, Q8_0, Q5_0, Q5_1: one fp32 scale per block of 32 (quantize_x8, gemv_int8_rows);
- Q4_K, Q5_K, Q6_K: one scale per K_X_BLOCK values (64; up to a super-block of 256, as llama.cpp's
  Q8_K) and int16 sums per 16 (quantize_x8k, gemv_int8k_rows, kernels/int8_super.h), so the 6- and
  8-bit sub-block scales multiply the integer sums in int32 lanes and each x scale takes one
  int-to-float conversion, not each block of 32.

Formats with an int8 kernel: INT8_FORMATS, every block format. Dense matrices, GPUs (several lanes
a row), the embedding lookup and the one-launch decode step keep the exact fp32 arithmetic;
config.DeviceFit turns the one launch off with int8 so that a row's result never depends on whether
its step had one row or several.

The int8 copy of x lives in buffers shared by every matrix that reads the same x buffer (one pair
per x on the device, sized from it), so it costs a fourth of x's memory once, not per matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyopencl as cl

from services.decode_fpga.launch import bind_rows

ACTIVATIONS = ("fp32", "int8")  # the setting's values: the exact path, or int8 activations
INT8_FORMATS = ("q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")  # every block format
K_FORMATS = ("q4_k", "q5_k", "q6_k")
# x's values a scale for the K-quants: 64, 128 or 256 (gemv_int8k_rows: one int-to-float conversion a
# scale), or 32 (gemv_int8_rows, every block's integer sum a float). 64: at 1B shapes 2.0-2.7x less CPU
# than fp32 a GEMV where 32 gives 1.2-1.6x and 256 2.1-2.9x, but 256 quadruples 32's KL divergence on
# ffn_down where 64 adds half of it (docs/decode-kernels.md); the others are kept for the benchmarks
K_X_BLOCKS = (32, 64, 128, 256)
K_X_BLOCK = 64


def check_activations(value: str) -> str:
    """value when it is one of ACTIVATIONS; else ValueError naming them."""
    if value not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {value!r}")
    return value


def takes_int8(dev, fmt: str, lanes: int) -> bool:
    """Whether a block matrix of `fmt` runs its paged-step GEMV on int8 activations on this device."""
    return getattr(dev, "activations", "fp32") == "int8" and fmt in INT8_FORMATS and lanes == 1


@dataclass(frozen=True)
class RowLaunches:
    """RowLaunches (or ByRowCounts) enqueued one after another over the same rows, as one."""

    parts: tuple

    def enqueue(self, queue: cl.CommandQueue, start: int, count: int) -> None:
        for launch in self.parts:
            launch.enqueue(queue, start, count)


def int8_rows(dev, x: cl.Buffer, cols: int, block: int = 32) -> tuple[cl.Buffer, ...]:
    """The int8 copy of x [n, cols] (xq, n * cols bytes) and its scales (dx, float [n, cols / block])
    for every n the buffer x holds, and for the K-quants' layout (block 64-256) x's int16 sums of 16
    (bsum, [n, cols / 16]);
    made once per x buffer, layout and device."""
    cache = dev.__dict__.setdefault("_int8_rows", {})
    key = (x.int_ptr, x.size, cols, block)
    if key not in cache:
        rows, flags = max(1, x.size // (4 * cols)), cl.mem_flags.READ_WRITE
        bufs = [cl.Buffer(dev.context, flags, rows * cols), cl.Buffer(dev.context, flags, rows * (cols // block) * 4)]
        if block > 32:
            bufs.append(cl.Buffer(dev.context, flags, rows * (cols // 16) * 2))
        cache[key] = tuple(bufs)
    return cache[key]


def bind_int8_gemv_rows(matrix, x: cl.Buffer, y: cl.Buffer, n_rows: cl.Buffer, accumulate: bool,
                        x_sums: cl.Buffer | None, build=None, k_block: int | None = None) -> RowLaunches:
    """QuantMatrix.bind_gemv_rows with int8 activations: quantize the step's rows of x, then the GEMV
    (rows read from n_rows[0]); x_sums: x's fp32 block sums, read by formats with minimums. build:
    in place of the device's (tests build the portable integer loop with it); k_block: x's block for a
    K-quant matrix in place of K_X_BLOCK (one of K_X_BLOCKS)."""
    from services.model.formats import kernel_defines

    if matrix.cols % 32:
        raise ValueError(f"{matrix.name}: int8 activations need whole 32-column blocks, got {matrix.cols} columns")
    if x_sums is None:
        if matrix.needs_block_sums:
            raise ValueError(f"{matrix.name}: a {matrix.fmt} GEMV needs the block sums of x (x_sums)")
        x_sums = x  # unread
    dev = matrix._dev
    d, m, q = matrix.device_arrays
    k_block = K_X_BLOCK if k_block is None else k_block
    if k_block not in K_X_BLOCKS:
        raise ValueError(f"x's block for K-quants must be one of {K_X_BLOCKS}, got {k_block}")
    if matrix.fmt in K_FORMATS and k_block > 32:
        program = (build or dev.build)("gemv_quant_int8.cl", {**kernel_defines(matrix.fmt), "K_XB": k_block})
        xq, dx, bsum = int8_rows(dev, x, matrix.cols, k_block)
        quantize = bind_rows(program, "quantize_x8k", (1, matrix.cols // 256), x, xq, dx, bsum, np.int32(matrix.cols),
                             rows_dim=0, by_row=True)
        gemv = bind_rows(program, "gemv_int8k_rows", (matrix.rows,), d, m, q, xq, dx, bsum, x_sums, y,
                         np.int32(matrix.cols), np.int32(matrix.rows), n_rows, np.int32(bool(accumulate)),
                         matrix._y_offset, matrix._y_stride, rows_dim=None, by_row=True)
        return RowLaunches((quantize, gemv))
    program = (build or dev.build)("gemv_quant_int8.cl", kernel_defines(matrix.fmt))
    xq, dx = int8_rows(dev, x, matrix.cols)
    nb = matrix.cols // 32
    quantize = bind_rows(program, "quantize_x8", (1, nb), x, xq, dx, np.int32(matrix.cols), rows_dim=0, by_row=True)
    gemv = bind_rows(program, "gemv_int8_rows", (matrix.rows,), d, m, q, xq, dx, x_sums, y, np.int32(matrix.cols),
                     np.int32(matrix.rows), n_rows, np.int32(bool(accumulate)), matrix._y_offset,
                     matrix._y_stride, rows_dim=None, by_row=True)
    return RowLaunches((quantize, gemv))

