"""The int8-activation block GEMVs (int8_gemv.py, kernels/gemv_quant_int8.cl, int8_super.h) against a
numpy model of their arithmetic: x quantized per block of 32 (per 64, 128 or 256 for the K-quants;
scale = largest |x| / 127, round half to even), the weights' integers times those int8 values, the
scales after, the minimums through x's fp32 block sums. Also: each row's result is the same bits in
any batch, the AVX2 builtins give the portable int loop's bits, the K-quants' x layout (int8, a scale
a chunk, int16 sums of 16), and a bad setting value fails when the device is chosen."""
from __future__ import annotations

import dataclasses

import numpy as np
import pyopencl as cl
import pytest

from services.decode_fpga.int8_gemv import INT8_FORMATS, K_FORMATS, K_X_BLOCK, bind_int8_gemv_rows, int8_rows
from services.decode_fpga.quant_gemv import QuantMatrix, split_blocks
from services.model.gguf_blocks import BlockTensor
from tests.decode_fpga.kquant_checkpoint import random_blocks
from tests.decode_fpga.test_kquant_gemv import numpy_factors
from tests.decode_fpga.test_quant_gemv import synthetic

MF = cl.mem_flags


@pytest.fixture(scope="module")
def int8_dev(cl_dev):
    """The session's device with int8 activations (its context, queue and programs shared)."""
    return dataclasses.replace(cl_dev, activations="int8")


def block_tensor(fmt: str, rows: int, cols: int, seed: int) -> BlockTensor:
    # gguf-py quantizes Q4_0, Q4_1 and Q8_0; the 5-bit formats and K-quants are random blocks made as bytes
    return synthetic(fmt, rows, cols, seed) if fmt in ("q4_0", "q4_1", "q8_0") else random_blocks(fmt, rows, cols, seed)


def x_block(fmt: str) -> int:
    """x's quantization block for a format: int8_gemv.K_X_BLOCK (64) for the K-quants, else 32."""
    return K_X_BLOCK if fmt in K_FORMATS else 32


def quantized(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """quantize_x8 (block 32) or quantize_x8k (256) in numpy: int8 [n, cols] and scales float32 [n, cols / block]."""
    xb = x.reshape(x.shape[0], -1, block)
    amax = np.abs(xb).max(axis=-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint((xb * inv[..., None]).astype(np.float32)), -127, 127)
    return q.reshape(x.shape).astype(np.int8), (amax / np.float32(127)).astype(np.float32)


def minimums(t: BlockTensor) -> np.ndarray | None:
    """Each block's minimum, float64 [rows, nb] (None for formats without)."""
    if t.qtype in ("q4_1", "q5_1"):
        return split_blocks(t)[1][:, :t.cols // 32].astype(np.float64)
    if t.qtype in ("q4_k", "q5_k"):
        return numpy_factors(t)[2].astype(np.float64)
    return None


def int8_reference(t: BlockTensor, x: np.ndarray, block: int | None = None) -> np.ndarray:
    """float64 of what the int8 path computes: W's (scale * integer) part times x's int8 values times
    their scales (x quantized per `block`, default the format's), plus the minimums times the fp32
    block sums of x."""
    block = block or x_block(t.qtype)
    xq, dx = quantized(x, block)
    xdeq = (xq.reshape(x.shape[0], -1, block).astype(np.float64) * dx[..., None]).reshape(x.shape)
    w = t.dequantize().astype(np.float64)  # scale * integer (+ minimum)
    y = xdeq @ w.T
    mins = minimums(t)
    if mins is not None:  # the minimums met xdeq's block sums above; the kernel uses x's own
        sums = x.reshape(x.shape[0], -1, 32).sum(axis=-1, dtype=np.float64)
        y += (sums - xdeq.reshape(x.shape[0], -1, 32).sum(axis=-1)) @ mins.T
    return y


def run_rows(dev, t: BlockTensor, x: np.ndarray, defines: dict | None = None,
             k_block: int | None = None) -> np.ndarray:
    """The paged step's GEMV (bind_gemv_rows) over the rows of x on dev; defines: extra build flags
    for gemv_quant_int8.cl, k_block: x's block for a K-quant (both bound directly)."""
    ctx, q = dev.context, dev.queue
    mat = QuantMatrix(dev, t)
    n = x.shape[0]
    xb = cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(x))
    sums = x.reshape(n, -1, 32).sum(axis=-1, dtype=np.float32)
    sb = cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=sums)
    yb = cl.Buffer(ctx, MF.READ_WRITE, n * t.rows * 4)
    nb = cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.array([n], np.int32))
    if defines or k_block:
        program_build = dev.build

        def build(name, d=None):
            return program_build(name, {**(d or {}), **(defines or {})})

        launch = bind_int8_gemv_rows(mat, xb, yb, nb, False, sb, build=build, k_block=k_block)
    else:
        launch = mat.bind_gemv_rows(xb, yb, nb, x_sums=sb)
    launch.enqueue(q, 0, n)
    out = np.empty((n, t.rows), np.float32)
    cl.enqueue_copy(q, out, yb, is_blocking=True)
    return out


@pytest.mark.parametrize("fmt", INT8_FORMATS)
def test_int8_gemv_is_the_int8_arithmetic(int8_dev, cl_dev, fmt):
    """Rows of 9 (passes of 4 and one alone) over 23 outputs: within 2e-6 of the float64 model of the
    int8 arithmetic, and measurably apart from the exact fp32 path (so the int8 kernel ran)."""
    cols = 512 if fmt.endswith("_k") else 32 * 13  # K: whole super-blocks; else an odd block count
    t = block_tensor(fmt, 23, cols, seed=3)
    x = np.random.default_rng(4).normal(size=(9, cols)).astype(np.float32)
    x[2, 64:96] = 0.0  # a block of zeros: scale 0
    got = run_rows(int8_dev, t, x)
    ref = int8_reference(t, x)
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 2e-6 * scale
    exact = run_rows(cl_dev, t, x)
    apart = np.abs(exact - got).max() / scale
    assert 1e-5 < apart < 3e-2, apart


@pytest.mark.parametrize("fmt", INT8_FORMATS)
def test_a_rows_result_does_not_depend_on_its_batch(int8_dev, fmt):
    """Each of 7 rows computed alone gives the bits it gets in the batch of 7 (passes of 4, then alone)."""
    cols = 256 if fmt.endswith("_k") else 32 * 7
    t = block_tensor(fmt, 17, cols, seed=5)
    x = np.random.default_rng(6).normal(size=(7, cols)).astype(np.float32)
    together = run_rows(int8_dev, t, x)
    for r in range(7):
        np.testing.assert_array_equal(run_rows(int8_dev, t, x[r:r + 1])[0], together[r])


@pytest.mark.parametrize("fmt", INT8_FORMATS)
def test_avx2_builtins_give_the_portable_bits(int8_dev, fmt):
    """The integer lanes are exact either way: the AVX2 build and the int16-loop build agree bit for bit."""
    cols = 256 if fmt.endswith("_k") else 32 * 9
    t = block_tensor(fmt, 11, cols, seed=7)
    x = np.random.default_rng(8).normal(size=(5, cols)).astype(np.float32) * 3
    np.testing.assert_array_equal(run_rows(int8_dev, t, x), run_rows(int8_dev, t, x, {"I8_PORTABLE": 1}))


def test_several_lanes_a_row_keep_the_exact_path(int8_dev, cl_dev):
    """A GPU's work-group kernels (here forced to 32 lanes a row) have no int8 form: the exact bits."""
    t = random_blocks("q4_k", 9, 256, seed=9)
    x = np.random.default_rng(10).normal(size=(3, 256)).astype(np.float32)
    wide = dataclasses.replace(int8_dev, lanes=32)
    np.testing.assert_array_equal(run_rows(wide, t, x), run_rows(dataclasses.replace(cl_dev, lanes=32), t, x))


def test_a_bad_activations_value_fails_at_start(monkeypatch):
    import pydantic

    from services.decode_fpga.device import select_device
    from services.decode_fpga.settings import DecodeSettings

    monkeypatch.delenv("HYBRIDSERVE_DECODE_ACTIVATIONS", raising=False)
    assert DecodeSettings().activations == "fp32"
    monkeypatch.setenv("HYBRIDSERVE_DECODE_ACTIVATIONS", "int8")
    assert DecodeSettings().activations == "int8"
    monkeypatch.setenv("HYBRIDSERVE_DECODE_ACTIVATIONS", "int4")
    with pytest.raises(pydantic.ValidationError, match="'fp32' or 'int8'"):
        DecodeSettings()
    with pytest.raises(ValueError, match="activations must be one of fp32, int8, got 'fp16'"):
        select_device(activations="fp16")


def test_stacked_parts_accumulate_into_their_rows(int8_dev):
    """A q|k|v-like stack of two formats, added onto y (the residual's accumulate): each part's rows
    land at its offset of the shared output, the int8 arithmetic's values plus what y held."""
    from services.decode_fpga.stacked_matrix import StackedMatrix

    cols, n = 256, 5
    parts = [block_tensor("q4_k", 12, cols, seed=11), block_tensor("q6_k", 7, cols, seed=12)]
    x = np.random.default_rng(13).normal(size=(n, cols)).astype(np.float32)
    y0 = np.random.default_rng(14).normal(size=(n, 19)).astype(np.float32)
    ctx, q = int8_dev.context, int8_dev.queue
    xb = cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=x)
    sb = cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=x.reshape(n, -1, 32).sum(axis=-1, dtype=np.float32))
    yb = cl.Buffer(ctx, MF.READ_WRITE | MF.COPY_HOST_PTR, hostbuf=y0)
    nb = cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.array([n], np.int32))
    stack = StackedMatrix(int8_dev, parts)  # held: a bound kernel does not keep its buffers alive
    stack.bind_gemv_rows(xb, yb, nb, accumulate=True, x_sums=sb).enqueue(q, 0, n)
    got = np.empty_like(y0)
    cl.enqueue_copy(q, got, yb, is_blocking=True)
    ref = np.concatenate([int8_reference(t, x) for t in parts], axis=1) + y0
    assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_k_quants_take_x_per_super_block(int8_dev, fmt):
    """With k_block=256 a K-quant's x has one scale a super-block, not a block of 32: with one large
    value in each super-block the result is the per-256 model's (within 2e-6), far from the per-32
    one's, which the kept per-32 kernel (k_block=32, the benchmarks' A/B) still computes."""
    t = block_tensor(fmt, 19, 512, seed=21)
    x = np.random.default_rng(22).normal(size=(6, 512)).astype(np.float32)
    x[:, 5] = 40.0  # sets super-block 0's scale: the rest of it keeps few levels
    x[:, 300] = -40.0
    got, ref256, ref32 = run_rows(int8_dev, t, x, k_block=256), int8_reference(t, x, 256), int8_reference(t, x, 32)
    scale = np.abs(ref256).max()
    assert np.abs(got - ref256).max() <= 2e-6 * scale
    assert np.abs(got - ref32).max() > 1e-3 * scale
    per32 = run_rows(int8_dev, t, x, k_block=32)
    assert np.abs(per32 - ref32).max() <= 2e-6 * scale


@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("k_block", (128, 256))
def test_k_quants_take_x_per_128_or_256(int8_dev, fmt, k_block):
    """The same kernel with an x scale each 128 or 256 values (int8_gemv.K_X_BLOCKS; the default 64 is
    every other test's): the model of that quantization within 2e-6, the AVX2 build the portable one's
    bits, a row's bits those it gets alone."""
    t = block_tensor(fmt, 13, 512, seed=27)
    x = np.random.default_rng(28).normal(size=(5, 512)).astype(np.float32)
    x[:, 70] = 30.0
    x[3, 128:256] = 0.0  # chunks of zeros: scale 0
    got = run_rows(int8_dev, t, x, k_block=k_block)
    ref = int8_reference(t, x, k_block)
    assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()
    np.testing.assert_array_equal(got, run_rows(int8_dev, t, x, {"I8_PORTABLE": 1}, k_block=k_block))
    np.testing.assert_array_equal(got[4], run_rows(int8_dev, t, x[4:5], k_block=k_block)[0])


@pytest.mark.parametrize("block", (64, 256))
def test_the_k_quants_x_layout(int8_dev, block):
    """quantize_x8k writes int8 x (round half to even, each chunk's largest to +-127; each 64 values as
    their 16-groups 0, 2, 1, 3, the order the pairs of blocks read), one scale a chunk of `block`
    (largest |x| / 127; 0 and zeros for a chunk of zeros) and the int16 sums of each 16 int8 values in
    x's own order, which Q6_K's offsets use."""
    cols, n = 768, 3
    x = np.random.default_rng(23).normal(size=(n, cols)).astype(np.float32) * 2
    x[1, 256:512] = 0.0
    t = block_tensor("q6_k", 4, cols, seed=24)
    ctx, q = int8_dev.context, int8_dev.queue
    xb = cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=x)
    yb = cl.Buffer(ctx, MF.READ_WRITE, n * t.rows * 4)
    nb = cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.array([n], np.int32))
    mat = QuantMatrix(int8_dev, t)
    bind_int8_gemv_rows(mat, xb, yb, nb, False, None, k_block=block).enqueue(q, 0, n)
    xq_b, dx_b, bsum_b = int8_rows(int8_dev, xb, cols, block)
    stored, dx = np.empty((n, cols), np.int8), np.empty((n, cols // block), np.float32)
    bsum = np.empty((n, cols // 16), np.int16)
    for host, buf in ((stored, xq_b), (dx, dx_b), (bsum, bsum_b)):
        cl.enqueue_copy(q, host, buf, is_blocking=True)
    xq = stored.reshape(n, -1, 4, 16)[:, :, [0, 2, 1, 3]].reshape(n, cols)  # the groups back in x's order
    want_q, want_d = quantized(x, block)
    np.testing.assert_array_equal(xq, want_q)
    np.testing.assert_array_equal(dx, want_d)
    np.testing.assert_array_equal(bsum, xq.reshape(n, -1, 16).sum(axis=-1, dtype=np.int32))
    assert (dx[1, 256 // block:512 // block] == 0).all() and not xq[1, 256:512].any()
    amax = np.abs(xq.astype(np.int32)).reshape(n, -1, block).max(axis=-1)
    assert (amax[dx > 0] == 127).all()


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_the_largest_k_quants_do_not_saturate(int8_dev, fmt):
    """Every quant at its largest, every scale byte at its extreme (Q6_K's -128) and |xq| = 127
    throughout: the integer lanes' bounds (int16 pairs, int32 sums over a super-block) hold, so the
    AVX2 build, the portable loop and the float64 model agree."""
    t = block_tensor(fmt, 5, 512, seed=25)
    raw = t.raw.copy().reshape(t.rows, 2, -1)
    if fmt == "q6_k":  # ql[128] qh[64] scales[16] d
        raw[..., :192] = 0xFF
        raw[..., 192:208] = 0x80
    else:  # d dmin scales[12] (qh[32] for Q5_K) qs
        raw[..., 4:] = 0xFF
    t = BlockTensor("w", fmt, t.rows, t.cols, raw.reshape(t.rows, -1), t.source)
    x = np.where(np.random.default_rng(26).random((5, 512)) < 0.5, -1.0, 1.0).astype(np.float32)
    x[1] = 1.0  # every product the same sign: the largest sums
    got = run_rows(int8_dev, t, x)
    np.testing.assert_array_equal(got, run_rows(int8_dev, t, x, {"I8_PORTABLE": 1}))
    ref = int8_reference(t, x)
    assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()
