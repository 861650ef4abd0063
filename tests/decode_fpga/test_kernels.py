"""Every OpenCL kernel against its numpy reference, on small random inputs (the attention kernels'
are in test_paged_attention.py)."""
from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from services.decode_fpga.gemv import upload_dense_matrix

MF = cl.mem_flags
rng = np.random.default_rng(0)


def buf(dev, a):
    return cl.Buffer(dev.context, MF.READ_WRITE | MF.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))


def read(dev, b, shape, dtype=np.float32):
    out = np.empty(shape, dtype)
    cl.enqueue_copy(dev.queue, out, b, is_blocking=True)
    return out


@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
@pytest.mark.parametrize("batch", [1, 3, 6])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemv_matches_numpy(cl_dev, fmt, batch, accumulate):
    w = rng.normal(size=(200, 96)).astype(np.float32)
    x = rng.normal(size=(batch, 96)).astype(np.float32)
    y0 = rng.normal(size=(batch, 200)).astype(np.float32)
    m = upload_dense_matrix(cl_dev, w, fmt)
    xb, yb = buf(cl_dev, x), buf(cl_dev, y0)
    m.enqueue_gemv(cl_dev.queue, xb, yb, batch, accumulate)
    stored = w.astype(np.float16).astype(np.float64) if fmt == "fp16" else w.astype(np.float64)
    ref = x.astype(np.float64) @ stored.T + (y0 if accumulate else 0)
    np.testing.assert_allclose(read(cl_dev, yb, (batch, 200)), ref, rtol=1e-5, atol=1e-4)


def test_dense_matrix_refuses_bad_shapes(cl_dev):
    with pytest.raises(ValueError, match="cols % 16"):
        upload_dense_matrix(cl_dev, np.zeros((4, 10), np.float32), "fp32")
    with pytest.raises(ValueError, match="dense format"):
        upload_dense_matrix(cl_dev, np.zeros((4, 16), np.float32), "int3")


def test_embed_rows(cl_dev):
    e = rng.normal(size=(50, 32)).astype(np.float32)
    m = upload_dense_matrix(cl_dev, e, "fp32")
    toks = np.array([7, 0, 49, 7], np.int32)
    xb = cl.Buffer(cl_dev.context, MF.READ_WRITE, 4 * 32 * 4)
    m.enqueue_embed(cl_dev.queue, buf(cl_dev, toks), xb, 4)
    np.testing.assert_array_equal(read(cl_dev, xb, (4, 32)), e[toks])


def block_sums_ref(a: np.ndarray) -> np.ndarray:
    """Sums of each row over 32-column blocks, the last one short when cols % 32 != 0."""
    return np.stack([a[:, b:b + 32].sum(1) for b in range(0, a.shape[1], 32)], 1)


@pytest.mark.parametrize("n", [64, 80])
def test_rms_norm(cl_dev, n):
    x = rng.normal(size=(5, n)).astype(np.float32)
    w = rng.normal(size=n).astype(np.float32)
    out = cl.Buffer(cl_dev.context, MF.READ_WRITE, x.nbytes)
    nb = (n + 31) // 32
    sums = cl.Buffer(cl_dev.context, MF.READ_WRITE, 5 * nb * 4)
    k = cl_dev.build("norm.cl").rms_norm
    k(cl_dev.queue, (5,), None, buf(cl_dev, x), buf(cl_dev, w), out, sums, np.int32(n), np.float32(1e-5))
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(read(cl_dev, out, x.shape), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(read(cl_dev, sums, (5, nb)), block_sums_ref(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ff", [40, 64])  # a short last block; whole blocks only (the 16-wide path)
def test_silu_mul(cl_dev, ff):
    gu = rng.normal(size=(3, 2 * ff)).astype(np.float32)
    act = cl.Buffer(cl_dev.context, MF.READ_WRITE, 3 * ff * 4)
    nb = (ff + 31) // 32
    sums = cl.Buffer(cl_dev.context, MF.READ_WRITE, 3 * nb * 4)
    cl_dev.build("elementwise.cl", {"ARGMAX_WG": 256}).silu_mul(cl_dev.queue, (3, nb), None, buf(cl_dev, gu), act,
                                                              sums, np.int32(ff))
    g, u = gu[:, :ff].astype(np.float64), gu[:, ff:]
    ref = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(read(cl_dev, act, (3, ff)), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(read(cl_dev, sums, (3, nb)), block_sums_ref(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab,ties", [(1000, [17, 600]), (49157, [5008, 5000]), (49157, [5003, 5001]),
                                        (49157, [49156, 49151])])
def test_argmax_takes_first_of_ties(cl_dev, vocab, ties):
    """Ties across work-items, within one vector lane, across lanes, and in a chunk's scalar tail
    (49157 is not a multiple of 8): the first index wins, as np.argmax and torch.argmax."""
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    logits[1, ties] = 50.0
    out = cl.Buffer(cl_dev.context, MF.READ_WRITE, 12)
    pos = buf(cl_dev, np.array([4, 0, 99], np.int32))
    k = cl_dev.build("elementwise.cl", {"ARGMAX_WG": 256}).argmax_rows
    k(cl_dev.queue, (3 * 256,), (256,), buf(cl_dev, logits), np.int32(vocab), out, pos)
    got = read(cl_dev, out, 3, np.int32)
    np.testing.assert_array_equal(got, np.argmax(logits, axis=1))
    assert got[1] == min(ties)
    np.testing.assert_array_equal(read(cl_dev, pos, 3, np.int32), [5, 1, 100])  # the next step's positions


# (RoPE, the KV write and attention: tests/decode_fpga/test_paged_attention.py)


def test_every_kernel_file_is_shipped_and_every_include_exists():
    """A non-editable install (deploy/Dockerfile) gets kernels/ through pyproject's package-data:
    every .cl and every header they include must match its globs, or the image cannot build them."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from services.decode_fpga.device import _INCLUDE, KERNEL_DIR

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "services.decode_fpga"]
    files = sorted(p.name for p in KERNEL_DIR.iterdir() if p.suffix in (".cl", ".h"))
    assert [f for f in files if not any(fnmatch.fnmatch(f"kernels/{f}", g) for g in globs)] == []
    included = {m for f in files for m in _INCLUDE.findall((KERNEL_DIR / f).read_text())}
    assert included and included <= set(files)
