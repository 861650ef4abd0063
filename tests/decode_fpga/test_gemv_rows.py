"""The batch-invariant GEMVs of the paged step (bind_gemv_rows: gemv_quant_rows, gemv_rows, and
gemv_quant_wg on a GPU): close to numpy, and every row bit for bit what a one-row launch gives it."""
from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from services.decode_fpga.gemv import DenseMatrix
from services.decode_fpga.quant_gemv import QuantMatrix
from tests.decode_fpga.test_quant_gemv import QTYPES, gemv_dev, reference, synthetic  # noqa: F401 (fixture)

MF = cl.mem_flags
N_ROWS = 9  # the several-row kernels' passes of 8 and 4 rows, and a one-row tail


def run_rows(dev, matrix, x: np.ndarray, y0: np.ndarray, accumulate: bool) -> np.ndarray:
    """bind_gemv_rows over x's rows (block sums made for it when the format reads them)."""
    n = x.shape[0]
    ctx, q = dev.context, dev.queue
    xb = cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(x))
    yb = cl.Buffer(ctx, MF.READ_WRITE | MF.COPY_HOST_PTR, hostbuf=y0.copy())
    nb = cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.array([n], np.int32))
    sums = None
    if matrix.needs_block_sums:
        sums = cl.Buffer(ctx, MF.READ_WRITE, n * (matrix.cols // 32) * 4)
        matrix.bind_block_sums(xb, sums, n).enqueue(q)
    matrix.bind_gemv_rows(xb, yb, nb, accumulate, sums).enqueue(q, 0, n)
    out = np.empty_like(y0)
    cl.enqueue_copy(q, out, yb, is_blocking=True)
    return out


def one_row(dev, matrix, x: np.ndarray, y0: np.ndarray, accumulate: bool) -> np.ndarray:
    """gemv's own one-row launch: the arithmetic every row must get."""
    ctx, q = dev.context, dev.queue
    xb = cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(x))
    yb = cl.Buffer(ctx, MF.READ_WRITE | MF.COPY_HOST_PTR, hostbuf=y0.copy())
    matrix.enqueue_gemv(q, xb, yb, 1, accumulate)
    out = np.empty_like(y0)
    cl.enqueue_copy(q, out, yb, is_blocking=True)
    return out


def check(dev, matrix, ref_fn, seed: int, accumulate: bool) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N_ROWS, matrix.cols)).astype(np.float32)
    y0 = rng.normal(size=(N_ROWS, matrix.rows)).astype(np.float32)
    got = run_rows(dev, matrix, x, y0, accumulate)
    ref = ref_fn(x, y0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    for r in range(N_ROWS):
        np.testing.assert_array_equal(got[r], one_row(dev, matrix, x[r:r + 1], y0[r:r + 1], accumulate)[0])


@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("accumulate", [False, True])
def test_block_gemv_rows_are_one_row_gemvs(gemv_dev, qtype, accumulate):
    t = synthetic(qtype, 70, 32 * 7)  # a block count that leaves ROW_DOT a tail
    check(gemv_dev, QuantMatrix(gemv_dev, t), lambda x, y0: reference(t, x, y0, accumulate), 3, accumulate)


@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
def test_dense_gemv_rows_are_one_row_gemvs(cl_dev, fmt):
    w = np.random.default_rng(5).normal(size=(45, 96)).astype(np.float32)
    m = DenseMatrix(cl_dev, w, fmt)
    stored = w.astype(np.float16 if fmt == "fp16" else np.float32).astype(np.float64)
    check(cl_dev, m, lambda x, y0: x.astype(np.float64) @ stored.T + y0, 6, True)
