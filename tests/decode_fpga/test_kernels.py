"""Every OpenCL kernel against its numpy reference, on small random inputs."""
from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from services.decode_fpga.gemv import upload_dense_matrix
from services.decode_fpga.kv_channels import ChannelLayout

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


def _rope_ref(v, pos, inv_freq):
    half = v.shape[-1] // 2
    ang = (np.float32(pos) * inv_freq).astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    a, b = v[:half], v[half:]
    return np.concatenate([a * c - b * s, b * c + a * s])


@pytest.mark.parametrize("fused_decode", [0, 1, 4, 32, 128],
                         ids=["two-launches", "fused", "fused-wg4", "fused-wg32", "fused-wg128"])
@pytest.mark.parametrize("n_channels,head_dim", [(1, 16), (3, 16), (1, 12), (1, 32)])
def test_rope_store_and_attention_match_numpy(cl_dev, n_channels, head_dim, fused_decode):
    """Two sequences in two slots, rows at different positions, GQA group of 2. One channel:
    one launch covers every kv head; three: one launch per head, as the engine does.
    head_dim 16 takes the kernel's 16-wide path, 12 its 4-wide one; 32 also writes block sums.
    fused_decode: the last two rows (one per sequence, a decode step) go through
    rope_attention_decode, which must store their K and V and attend as the two launches do: with
    one work-item per (row, head) (fused_decode 1, attention.cl) or a work-group of that many lanes
    (4: tiles of 4 positions, several dimensions per lane; 32, 128: idle lanes; attention_wg.cl)."""
    n_heads, n_kv, ctx = 4, 2, 40
    group, q_dim, kv_dim = n_heads // n_kv, n_heads * head_dim, n_kv * head_dim
    lay = ChannelLayout(n_layers=1, n_kv_heads=n_kv, head_dim=head_dim, max_context=ctx, n_slots=2,
                        n_channels=n_channels)
    prog = cl_dev.build("attention.cl", {"HEAD_DIM": head_dim, "GROUP": group, "Q_DIM": q_dim, "KV_DIM": kv_dim})
    chans = [cl.Buffer(cl_dev.context, MF.READ_WRITE, max(4, lay.channel_elems(c) * 4)) for c in range(n_channels)]
    inv_freq = (1.0 / (1e4 ** (np.arange(0, head_dim, 2) / head_dim))).astype(np.float32)
    # slot 0 gets a 35-token "prefill" (past two 16-position tiles of the softmax), then slot 1 a
    # 3-token one; then one decode row each
    rows = [(0, p) for p in range(35)] + [(1, p) for p in range(3)] + [(0, 35), (1, 3)]
    qkv = rng.normal(size=(len(rows), q_dim + 2 * kv_dim)).astype(np.float32)
    out_b = cl.Buffer(cl_dev.context, MF.READ_WRITE, len(rows) * q_dim * 4)
    sums_b = cl.Buffer(cl_dev.context, MF.READ_WRITE, len(rows) * max(1, q_dim // 32) * 4)
    # the RoPE table the engine computes once at start-up: cos | sin of every position's angles
    rope_cs = cl.Buffer(cl_dev.context, MF.READ_WRITE, ctx * head_dim * 4)
    cl.Kernel(prog, "rope_table")(cl_dev.queue, (ctx, head_dim // 2), None, buf(cl_dev, inv_freq), rope_cs)
    angles = np.arange(ctx, dtype=np.float32)[:, None] * inv_freq[None, :]
    np.testing.assert_allclose(read(cl_dev, rope_cs, (ctx, head_dim)), np.concatenate([np.cos(angles), np.sin(angles)], 1),
                               rtol=1e-6, atol=1e-6)
    span = n_kv if n_channels == 1 else 1
    rope_store, attention = cl.Kernel(prog, "rope_store_kv"), cl.Kernel(prog, "attention")
    fused, lanes = cl.Kernel(prog, "rope_attention_decode"), fused_decode
    if lanes > 1:
        prog_wg = cl_dev.build("attention_wg.cl", {"HEAD_DIM": head_dim, "GROUP": group, "Q_DIM": q_dim,
                                                   "KV_DIM": kv_dim, "WG": lanes})
        fused = cl.Kernel(prog_wg, "rope_attention_decode_wg")
    split = len(rows) - 2 if fused_decode else len(rows)
    phases = [(0, split, False), (split, len(rows), True)] if fused_decode else [(0, len(rows), False)]
    for start, end, decode in phases:
        n = end - start
        qkv_p = buf(cl_dev, qkv[start:end])
        slots = buf(cl_dev, np.array([r[0] for r in rows[start:end]], np.int32))
        pos = buf(cl_dev, np.array([r[1] for r in rows[start:end]], np.int32))
        out_p = cl.Buffer(cl_dev.context, MF.READ_WRITE, n * q_dim * 4)
        sums_p = cl.Buffer(cl_dev.context, MF.READ_WRITE, n * max(1, q_dim // 32) * 4)
        for h in range(0, n_kv, span):
            kc, kb = lay.locate(0, 0, 0, h)
            vc, vb = lay.locate(0, 0, 1, h)
            ks, vs = lay.locate(1, 0, 0, h)[1] - kb, lay.locate(1, 0, 1, h)[1] - vb
            args = (chans[kc], np.int64(kb), np.int64(ks), chans[vc], np.int64(vb), np.int64(vs),
                    np.int64(lay.plane_elems))
            if decode:
                fused(cl_dev.queue, (n * lanes, span * group), (lanes, 1), qkv_p, slots, pos, rope_cs, np.int32(h),
                      np.float32(head_dim ** -0.5), *args, out_p, sums_p)
                continue
            rope_store(cl_dev.queue, (n, span * (group + 1)), None, qkv_p, slots, pos, rope_cs, np.int32(h), *args)
            attention(cl_dev.queue, (n, span * group), None, qkv_p, slots, pos, np.int32(h),
                      np.float32(head_dim ** -0.5), *args, out_p, sums_p)
        cl.enqueue_copy(cl_dev.queue, out_b, out_p, byte_count=n * q_dim * 4, dst_offset=start * q_dim * 4)
        cl.enqueue_copy(cl_dev.queue, sums_b, sums_p, byte_count=n * max(1, q_dim // 32) * 4,
                        dst_offset=start * max(1, q_dim // 32) * 4)
    got = read(cl_dev, out_b, (len(rows), q_dim))
    # numpy reference: rope q and k, causal attention within each slot
    cache = {}
    for i, (slot, p) in enumerate(rows):
        for h in range(n_kv):
            k = _rope_ref(qkv[i, q_dim + h * head_dim: q_dim + (h + 1) * head_dim], p, inv_freq)
            v = qkv[i, q_dim + kv_dim + h * head_dim: q_dim + kv_dim + (h + 1) * head_dim]
            cache[(slot, h, p)] = (k, v)
    for i, (slot, p) in enumerate(rows):
        for h in range(n_heads):
            q = _rope_ref(qkv[i, h * head_dim:(h + 1) * head_dim], p, inv_freq)
            ks = np.stack([cache[(slot, h // group, t)][0] for t in range(p + 1)])
            vs = np.stack([cache[(slot, h // group, t)][1] for t in range(p + 1)])
            s = ks @ q / np.sqrt(head_dim)
            w = np.exp(s - s.max())
            ref = (w / w.sum()) @ vs
            np.testing.assert_allclose(got[i, h * head_dim:(h + 1) * head_dim], ref, rtol=1e-4, atol=1e-5)
    for slot, p in rows[-2:]:  # the decode rows' K and V are in the cache, roped K
        for h in range(n_kv):
            k_ref, v_ref = cache[(slot, h, p)]
            for kv, ref in ((0, k_ref), (1, v_ref)):
                c, off = lay.locate(slot, 0, kv, h)
                plane = read(cl_dev, chans[c], lay.channel_elems(c))[off + p * head_dim: off + (p + 1) * head_dim]
                np.testing.assert_allclose(plane, ref, rtol=1e-5, atol=1e-6)
    if head_dim % 32 == 0:
        np.testing.assert_allclose(read(cl_dev, sums_b, (len(rows), q_dim // 32)), block_sums_ref(got),
                                   rtol=1e-5, atol=1e-5)


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
