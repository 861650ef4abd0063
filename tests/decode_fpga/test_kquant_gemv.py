"""The 5-bit and K-quant block kernels (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) against gguf's own dequantization:
the device arrays, a numpy reference of them, and every kernel that reads them (one row, several rows,
the batch-invariant rows of the paged step, the norm and SiLU prologues, the embedding lookup), on
random blocks made as bytes (gguf-py cannot quantize to K-quants; any sane-scaled bytes are blocks)."""
from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest
from gguf.quants import dequantize

from services.decode_fpga.quant_gemv import QuantMatrix, split_blocks
from services.model.gguf_blocks import BlockTensor, as_q8_0, stack_exact
from tests.decode_fpga.kquant_checkpoint import ggml_type, random_blocks
from tests.decode_fpga.test_gemv_rows import N_ROWS, check, one_row, run_rows
from tests.decode_fpga.test_quant_gemv import gemv_dev, run_gemv, synthetic  # noqa: F401 (fixture)

KTYPES = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
MF = cl.mem_flags


def cols_for(qtype: str, blocks32: int) -> int:
    """A row width of about `blocks32` 32-blocks that the type can hold (K-quants: whole 256s)."""
    return 256 * max(1, blocks32 // 8) if qtype.endswith("_k") else 32 * blocks32


def ggufs(t: BlockTensor) -> np.ndarray:
    return dequantize(t.raw, ggml_type(t.qtype)).reshape(t.rows, t.cols)


def reference(t: BlockTensor, x: np.ndarray, y0: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ ggufs(t).astype(np.float64).T + y0


def numpy_factors(t: BlockTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The numpy reference of the kernels' factors, from the device arrays (split_blocks) as
    quant_blocks.h reads them: the integers (q - offset) as float32 [rows, nb, 32], each half-block's
    scale float32 [rows, nb, 2] (the same for both halves but in Q6_K), and each block's minimum
    float32 [rows, nb] (None without). A weight is q * scale (+ minimum)."""
    d, m, q = split_blocks(t)
    nb = t.cols // 32
    qbytes = q.shape[1] // nb
    q = q.reshape(t.rows, nb, qbytes).astype(np.int32)
    v = np.concatenate([q[..., :16] & 15, q[..., :16] >> 4], axis=-1)
    if qbytes == 20:  # fifth bits: a little-endian uint a block
        bits = np.ascontiguousarray(q[..., 16:20].astype(np.uint8)).view("<u4")
        v |= ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32) << 4
    elif qbytes == 24:  # weights 0..15 whole, 16 + j: 2 bits atop byte j, 4 at bit 32 (j & 1) + 4 (j >> 1)
        high = np.ascontiguousarray(q[..., 16:24].astype(np.uint8)).view("<u8").astype(np.uint64)
        j = np.arange(16, dtype=np.uint64)
        nibble = ((high >> (32 * (j & 1) + 4 * (j >> 1))) & 15).astype(np.int32)
        v = np.concatenate([q[..., :16] & 63, (q[..., :16] >> 6) | nibble << 2], axis=-1)
    offset = {"q5_0": 16, "q6_k": 32}.get(t.qtype, 0)
    vf = (v - offset).astype(np.float32)
    if t.qtype == "q6_k":  # a scale per 16 weights: d_super * the half's int8
        scale = d[:, :, None] * m.view(np.int8).reshape(t.rows, -1, 16).astype(np.float32)
        return vf, scale.reshape(t.rows, nb, 2), None
    if t.qtype in ("q4_k", "q5_k"):  # d_super * sc_b, -(dmin_super * mn_b)
        ints = m.reshape(t.rows, -1, 8, 2).astype(np.float32)
        sup = d.reshape(t.rows, -1, 1, 2)
        scale = (sup[..., 0] * ints[..., 0]).reshape(t.rows, nb)
        minimum = -(sup[..., 1] * ints[..., 1]).reshape(t.rows, nb)
    else:
        scale, minimum = d[:, :nb], (m[:, :nb].astype(np.float32) if m is not None else None)
    return vf, np.repeat(scale[..., None], 2, axis=-1), minimum


def numpy_weights(t: BlockTensor) -> np.ndarray:
    """The weights rebuilt from numpy_factors, float32 [rows, cols]."""
    vf, scale, minimum = numpy_factors(t)
    w = (vf.reshape(*vf.shape[:2], 2, 16) * scale[..., None]).reshape(vf.shape)
    if minimum is not None:
        w = w + minimum[..., None]
    return w.reshape(t.rows, t.cols)


@pytest.mark.parametrize("qtype", KTYPES)
def test_numpy_reference_of_the_device_arrays_is_ggufs(qtype):
    """split_blocks only moves bits or multiplies exactly: the weights rebuilt from its arrays are
    gguf.quants.dequantize's, bit for bit (the padding of scales is zero)."""
    t = random_blocks(qtype, 6, cols_for(qtype, 24), seed=1)
    d, m, _ = split_blocks(t)
    assert d.dtype == np.float32 and (m is None) == (qtype == "q5_0")
    np.testing.assert_array_equal(numpy_weights(t), ggufs(t))
    np.testing.assert_array_equal(t.dequantize(), ggufs(t))


@pytest.mark.parametrize("qtype", KTYPES)
def test_kernel_weights_are_ggufs_bit_for_bit(gemv_dev, qtype):
    """One-hot rows of x read the matrix back through the kernel (the several-row passes)."""
    t = random_blocks(qtype, 19, 256, seed=2)
    eye = np.eye(t.cols, dtype=np.float32)
    got = run_gemv(gemv_dev, t, eye, np.zeros((t.cols, t.rows), np.float32), False)
    np.testing.assert_array_equal(got.T, ggufs(t))


@pytest.mark.parametrize("qtype", KTYPES)
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_gemv_matches_gguf_dequantize(gemv_dev, qtype, batch):
    """One row (scales out of the inner loop, minimums through block sums, an odd block count for
    the 5-bit types), and the several-row passes of 8 and 4; accumulating into y."""
    t = random_blocks(qtype, 37, cols_for(qtype, 17), seed=batch)
    rng = np.random.default_rng(batch)
    x = rng.normal(size=(batch, t.cols)).astype(np.float32)
    y0 = rng.normal(size=(batch, t.rows)).astype(np.float32)
    ref = reference(t, x, y0)
    np.testing.assert_allclose(run_gemv(gemv_dev, t, x, y0, True), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", KTYPES)
def test_batched_rows_are_one_row_gemvs(gemv_dev, qtype):
    """The paged step's GEMV (bind_gemv_rows): close to gguf's, and every row bit for bit the one-row GEMV."""
    t = random_blocks(qtype, 45, cols_for(qtype, 7), seed=3)
    check(gemv_dev, QuantMatrix(gemv_dev, t), lambda x, y0: reference(t, x, y0), 3, True)


@pytest.mark.parametrize("qtype", KTYPES)
def test_factored_products(gemv_dev, qtype):
    """The factored GEMV (quant_blocks.h): a half-block's integers times x first, then its scale, in
    one row and in the batched rows alike. A row of x that is v at column c alone gives exactly
    float32(float32((q - offset) v) * scale) (+ the minimum times the block's sum of x, v): numpy's
    value of that order, which scaling the weights first (float32(w v)) does not give for every c."""
    if gemv_dev.lanes_per_row > 1:
        pytest.skip("the work-group kernels (gemv_quant_wg.cl, a GPU's) dequantize each weight first")
    t = random_blocks(qtype, 21, 512, seed=9)
    rng = np.random.default_rng(9)
    cols = rng.choice(t.cols, size=N_ROWS, replace=False)
    v = rng.normal(size=N_ROWS).astype(np.float32)
    x = np.zeros((N_ROWS, t.cols), np.float32)
    x[np.arange(N_ROWS), cols] = v
    vf, scale, minimum = numpy_factors(t)
    q = vf.reshape(t.rows, t.cols)[:, cols].T  # [N_ROWS, rows]
    sc = scale.reshape(t.rows, -1)[:, cols // 16].T
    want = (q * v[:, None]).astype(np.float32) * sc
    if minimum is not None:
        want = want + minimum[:, cols // 32].T * v[:, None]
    scaled_first = ggufs(t)[:, cols].T * v[:, None]  # float32(w v): a different rounding
    assert qtype == "q5_1" or not np.array_equal(want, scaled_first)
    m = QuantMatrix(gemv_dev, t)
    zeros = np.zeros((N_ROWS, t.rows), np.float32)
    np.testing.assert_array_equal(run_rows(gemv_dev, m, x, zeros, False), want)
    for r in range(N_ROWS):
        np.testing.assert_array_equal(one_row(gemv_dev, m, x[r:r + 1], zeros[r:r + 1], False)[0], want[r])


@pytest.mark.parametrize("qtype", KTYPES)
def test_fused_norm_and_silu_prologues(cl_dev, qtype):
    """gemv_quant_norm and gemv_quant_silu (one decode row): against numpy, and bit for bit the
    launches they replace (rms_norm / silu_mul, then the GEMV)."""
    rows, cols = 40, 512
    t = random_blocks(qtype, rows, cols, seed=4)
    m = QuantMatrix(cl_dev, t)
    rng = np.random.default_rng(4)
    x, nw, gu = (rng.normal(size=n).astype(np.float32) for n in (cols, cols, 2 * cols))
    y0 = rng.normal(size=rows).astype(np.float32)
    ctx, q = cl_dev.context, cl_dev.queue

    def buf(a):
        return cl.Buffer(ctx, MF.READ_WRITE | MF.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))

    def read(b):
        out = np.empty(rows, np.float32)
        cl.enqueue_copy(q, out, b, is_blocking=True)
        return out

    xb, nwb, gub = buf(x), buf(nw), buf(gu)
    y_norm, y_silu, y2, y3 = buf(y0), buf(y0), buf(y0), buf(y0)
    launch = m.bind_gemv_norm(xb, nwb, 1e-5, y_norm, True)
    cl.enqueue_nd_range_kernel(q, launch.kernel, launch.global_size, (8,))  # 5 work-groups, each its own norm
    launch = m.bind_gemv_silu(gub, y_silu, True)
    cl.enqueue_nd_range_kernel(q, launch.kernel, launch.global_size, (8,))
    xn, sums = buf(np.zeros(cols, np.float32)), buf(np.zeros(cols // 32, np.float32))
    cl.Kernel(cl_dev.build("norm.cl"), "rms_norm")(q, (1,), None, xb, nwb, xn, sums, np.int32(cols),
                                                    np.float32(1e-5))
    m.bind_gemv(xn, y2, 1, True, x_sums=sums).enqueue(q)
    act, act_sums = buf(np.zeros(cols, np.float32)), buf(np.zeros(cols // 32, np.float32))
    cl.Kernel(cl_dev.build("elementwise.cl", {"ARGMAX_WG": 256}), "silu_mul")(q, (1, cols // 32), None, gub, act,
                                                                            act_sums, np.int32(cols))
    m.bind_gemv(act, y3, 1, True, x_sums=act_sums).enqueue(q)
    np.testing.assert_array_equal(read(y_norm), read(y2))
    np.testing.assert_array_equal(read(y_silu), read(y3))
    x64 = x.astype(np.float64)
    ref_norm = reference(t, (x64 / np.sqrt((x64 ** 2).mean() + 1e-5) * nw)[None], y0[None])[0]
    g = gu[:cols].astype(np.float64)
    ref_silu = reference(t, (g / (1 + np.exp(-g)) * gu[cols:])[None], y0[None])[0]
    for got, ref in ((read(y_norm), ref_norm), (read(y_silu), ref_silu)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", KTYPES)
def test_embed_rows_are_ggufs(cl_dev, qtype):
    t = random_blocks(qtype, 50, 256, seed=6)
    m = QuantMatrix(cl_dev, t)
    ids = np.array([3, 49, 0, 3], np.int32)
    tb = cl.Buffer(cl_dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=ids)
    xb = cl.Buffer(cl_dev.context, MF.READ_WRITE, ids.size * t.cols * 4)
    m.enqueue_embed(cl_dev.queue, tb, xb, ids.size)
    got = np.empty((ids.size, t.cols), np.float32)
    cl.enqueue_copy(cl_dev.queue, got, xb, is_blocking=True)
    np.testing.assert_array_equal(got, ggufs(t)[ids])


@pytest.mark.parametrize("qtype", ["q4_0", "q5_0"])
def test_symmetric_blocks_become_q8_0_exactly(qtype):
    """A Q4_0/Q5_0 part beside a Q8_0 one (q|k|v of a Q4_K_M file with rows not a multiple of 256)
    is stacked as Q8_0 with the same weights, so the stack keeps one block format."""
    t = random_blocks("q5_0", 6, 96, seed=7) if qtype == "q5_0" else synthetic("q4_0", 6, 96, seed=7)
    q8 = as_q8_0(t)
    assert q8.qtype == "q8_0"
    np.testing.assert_array_equal(q8.dequantize(), t.dequantize())
    stacked = stack_exact("qkv", [t, synthetic("q8_0", 4, 96, seed=8)])
    assert stacked.qtype == "q8_0" and stacked.rows == 10
    np.testing.assert_array_equal(stacked.dequantize()[:6], t.dequantize())
    with pytest.raises(ValueError, match="formats differ"):
        stack_exact("qkv", [random_blocks("q4_k", 4, 256), random_blocks("q6_k", 4, 256)])


@pytest.mark.parametrize("qtype", KTYPES)
def test_fused_norm_on_gpu_shaped_kernels(gemv_dev, qtype):
    """bind_gemv_norm with a work-group of lanes per row (gemv_quant_norm_wg, a GPU's) as with one
    work-item (gemv_quant_norm): against numpy."""
    rows, cols = 24, 512
    t = random_blocks(qtype, rows, cols, seed=5)
    m = QuantMatrix(gemv_dev, t)
    rng = np.random.default_rng(5)
    x, nw = (rng.normal(size=cols).astype(np.float32) for _ in range(2))
    ctx, q = gemv_dev.context, gemv_dev.queue
    xb, nwb = (cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=a) for a in (x, nw))
    yb = cl.Buffer(ctx, MF.READ_WRITE, rows * 4)
    m.bind_gemv_norm(xb, nwb, 1e-5, yb).enqueue(q)
    got = np.empty(rows, np.float32)
    cl.enqueue_copy(q, got, yb, is_blocking=True)
    x64 = x.astype(np.float64)
    ref = reference(t, (x64 / np.sqrt((x64 ** 2).mean() + 1e-5) * nw)[None], np.zeros((1, rows)))[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
