"""kernels/paged_attention.cl on real PoCL: the RoPE table, every kernel against the float64 numpy
reference (head sizes that take head_vector.h's 16-wide and 4-wide paths, and block sums), bit for
bit against itself in other batches and block placements, and the CPU device's scores kernels
(prefill chunks, decode rows) bit for bit against the portable ones."""
from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from services.decode_fpga.paged_attention import (
    PagedAttention, PagedKVLayout, attention_ref, check_rows, gather_kv, kv_write_ref, pack_block_tables, rope_ref)

MF = cl.mem_flags
POISON = np.float32(-7.25e7)  # what a block nobody wrote holds; any read of it wrecks a softmax
TINY = dict(n_heads=4, n_kv=2, head_dim=16, block_size=4)
MODEL = dict(n_heads=9, n_kv=3, head_dim=64, block_size=16)  # SmolLM2-135M's attention
# the tiny checkpoints' attention (tests/model/tiny_checkpoints.py): heads of 32, where PoCL contracted
# `score * scale - m` into an fma in one kernel and not in its scores twin (paged_attention.h)
HEAD32 = dict(n_heads=4, n_kv=2, head_dim=32, block_size=16)
HEAD12 = dict(n_heads=4, n_kv=2, head_dim=12, block_size=4)  # head_vector.h's 4-wide path (NV float4s)


def buf(dev, a):
    return cl.Buffer(dev.context, MF.READ_WRITE | MF.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))


def read(dev, b, shape, dtype=np.float32):
    out = np.empty(shape, dtype)
    cl.enqueue_copy(dev.queue, out, b, is_blocking=True)
    return out


class Case:
    """One model shape on the device: layout, launchers, rope table, a poisoned pool image."""

    def __init__(self, dev, n_heads, n_kv, head_dim, block_size, num_blocks=64, n_layers=2, max_pos=256):
        self.dev, self.n_heads, self.n_kv, self.hd = dev, n_heads, n_kv, head_dim
        self.layout = PagedKVLayout(n_layers, n_kv, head_dim, block_size, num_blocks)
        self.pa = PagedAttention(dev, self.layout, n_heads)
        self.group, self.q_dim, self.kv_dim = self.pa.group, self.pa.q_dim, self.pa.kv_dim
        self.shape_defs = {"HEAD_DIM": head_dim, "GROUP": self.group, "Q_DIM": self.q_dim, "KV_DIM": self.kv_dim}
        self.inv_freq = (1.0 / (1e4 ** (np.arange(0, head_dim, 2) / head_dim))).astype(np.float32)
        self.rope_cs = cl.Buffer(dev.context, MF.READ_WRITE, max_pos * head_dim * 4)
        self.inv_freq_b = buf(dev, self.inv_freq)  # held: released under a running command, PoCL crashes
        self.pa.bind_rope_table(max_pos, self.inv_freq_b, self.rope_cs).enqueue(dev.queue)
        self.image = np.full(self.layout.shape, POISON, np.float32)

    def fill_context(self, rng, layer, tables, lengths):
        """Random (already roped) K and V at positions [0, n) of each sequence, in the host image."""
        for s, n in enumerate(lengths):
            kv = rng.normal(size=(n, 2, self.n_kv, self.hd)).astype(np.float32)
            kv_write_ref(self.image, layer, kv[:, 0], kv[:, 1], np.full(n, s), np.arange(n), tables)

    def qkv(self, rng, rows):
        return rng.normal(size=(rows, self.q_dim + 2 * self.kv_dim)).astype(np.float32)

    def split(self, qkv):
        """q [rows, n_heads, hd], k and v [rows, n_kv, hd] of q|k|v rows."""
        r = len(qkv)
        q = qkv[:, :self.q_dim].reshape(r, self.n_heads, self.hd)
        k = qkv[:, self.q_dim:self.q_dim + self.kv_dim].reshape(r, self.n_kv, self.hd)
        return q, k, qkv[:, self.q_dim + self.kv_dim:].reshape(r, self.n_kv, self.hd)

    def run(self, kernel, qkv, seq_of_row, pos, tables, layer, image=None):
        """One launch of `kernel` ('decode', 'rope_store+attention' or 'write') on a copy of the
        image; returns (out [rows, q_dim], out_sums, pool image after, qkv after)."""
        n = len(pos)
        max_blocks = max(len(t) for t in tables)
        packed = pack_block_tables(tables, max_blocks)
        check_rows(self.layout, packed, seq_of_row.astype(np.int32), pos.astype(np.int32))
        pool = buf(self.dev, self.image if image is None else image)
        qkv_b, sb, pb, tb = (buf(self.dev, a) for a in (qkv, seq_of_row.astype(np.int32), pos.astype(np.int32),
                                                        packed))
        out = cl.Buffer(self.dev.context, MF.READ_WRITE, n * self.q_dim * 4)
        sums = cl.Buffer(self.dev.context, MF.READ_WRITE, n * max(1, self.q_dim // 32) * 4)
        if kernel == "decode":
            launches = [self.pa.bind_decode(n, qkv_b, sb, pb, self.rope_cs, tb, max_blocks, pool, layer, out, sums)]
        elif kernel == "rope_store+attention":
            launches = [self.pa.bind_rope_store(n, qkv_b, sb, pb, self.rope_cs, tb, max_blocks, pool, layer),
                        self.pa.bind_attention(n, qkv_b, sb, pb, tb, max_blocks, pool, layer, out, sums)]
        else:
            launches = [self.pa.bind_qkv_write(n, qkv_b, sb, pb, tb, max_blocks, pool, layer)]
        for launch in launches:
            launch.enqueue(self.dev.queue)
        got = read(self.dev, out, (n, self.q_dim)) if kernel != "write" else None
        got_sums = read(self.dev, sums, (n, max(1, self.q_dim // 32))) if kernel != "write" else None
        return got, got_sums, read(self.dev, pool, self.layout.shape), read(self.dev, qkv_b, qkv.shape)


def scattered_tables(rng, num_blocks, lengths, block_size, extra=0):
    """Disjoint tables of random, non-monotonic block ids covering lengths[s] + extra positions."""
    need = [(n + extra + block_size - 1) // block_size for n in lengths]
    ids = rng.permutation(num_blocks)[:sum(need)].tolist()
    return [ids[sum(need[:s]):sum(need[:s + 1])] for s in range(len(lengths))]


def test_layout_from_budget_and_refusals():
    per_block = 30 * 2 * 3 * 16 * 64 * 4  # SmolLM2-135M, float32: 720 KiB a block of 16 tokens
    lay = PagedKVLayout.from_budget(2048 * per_block, n_layers=30, n_kv_heads=3, head_dim=64)
    assert lay.num_blocks == 2048 and lay.nbytes == 2048 * per_block  # 64 sequences of 512 tokens
    assert PagedKVLayout.from_budget(2048 * per_block - 1, n_layers=30, n_kv_heads=3, head_dim=64).num_blocks == 2047
    assert lay.layer_base(2) == 2 * lay.num_blocks * 2 * 3 * 16 * 64
    with pytest.raises(ValueError, match="holds no block"):
        PagedKVLayout.from_budget(per_block - 1, n_layers=30, n_kv_heads=3, head_dim=64)
    with pytest.raises(ValueError, match="layer 30"):
        lay.layer_base(30)
    small = PagedKVLayout(1, 1, 16, 4, 8)
    packed = pack_block_tables([[3, 1], [7]], 3)
    np.testing.assert_array_equal(packed, [[3, 1, -1], [7, -1, -1]])
    check_rows(small, packed, np.array([0, 1]), np.array([7, 3]))
    with pytest.raises(ValueError, match="outside"):  # position 8 needs a third block: padding
        check_rows(small, packed, np.array([0]), np.array([8]))
    with pytest.raises(ValueError, match="needs 4 blocks"):
        check_rows(small, packed, np.array([1]), np.array([12]))
    with pytest.raises(ValueError, match="outside"):
        check_rows(small, pack_block_tables([[8]], 1), np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match="without a table"):
        check_rows(small, packed, np.array([2]), np.array([0]))


@pytest.mark.parametrize("shape", [TINY, MODEL], ids=["tiny", "model"])
def test_kv_write_puts_rows_where_tables_say_and_nowhere_else(cl_dev, shape):
    rng = np.random.default_rng(1)
    c = Case(cl_dev, **shape)
    lengths = [1, 2 * shape["block_size"] + 3, 5]
    tables = scattered_tables(rng, c.layout.num_blocks, lengths, shape["block_size"])
    seq_of_row = np.concatenate([np.full(n, s) for s, n in enumerate(lengths)])
    pos = np.concatenate([rng.permutation(n) for n in lengths])  # rows in any order
    qkv = c.qkv(rng, len(pos))
    _, k, v = c.split(qkv)
    _, _, pool, _ = c.run("write", qkv, seq_of_row, pos, tables, layer=1)
    want = c.image.copy()
    kv_write_ref(want, 1, k, v, seq_of_row, pos, tables)
    np.testing.assert_array_equal(pool, want)  # every other float still the poison
    assert (pool == POISON).sum() == pool.size - 2 * len(pos) * c.kv_dim

    # the wire layout of one layer ([2, n_kv, n_tokens, hd]) read in place by the same kernel
    n = lengths[1]
    wire = rng.normal(size=(2, c.n_kv, n, c.hd)).astype(np.float32)
    max_blocks = len(tables[1])
    # (every buffer named until the read: PoCL crashes when one is released under a running command)
    pool_b, tb = buf(cl_dev, c.image), buf(cl_dev, pack_block_tables([tables[1]], max_blocks))
    wire_b, seq_b = buf(cl_dev, wire), buf(cl_dev, np.zeros(n, np.int32))
    pos_b = buf(cl_dev, np.arange(n, dtype=np.int32))
    c.pa.bind_kv_write(n, wire_b, 0, c.hd, c.n_kv * n * c.hd, n * c.hd, seq_b, pos_b, tb, max_blocks, pool_b,
                       0).enqueue(cl_dev.queue)
    got = read(cl_dev, pool_b, c.layout.shape)
    np.testing.assert_array_equal(gather_kv(got, 0, tables[1], n), wire)
    want = c.image.copy()
    kv_write_ref(want, 0, wire[0].transpose(1, 0, 2), wire[1].transpose(1, 0, 2), np.zeros(n, int), np.arange(n),
                 [tables[1]])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("head_dim", [16, 12])
def test_rope_table_holds_cos_and_sin_of_every_angle(cl_dev, head_dim):
    """The table the engine computes once at start-up: cos | sin of every position's angles."""
    c = Case(cl_dev, n_heads=4, n_kv=2, head_dim=head_dim, block_size=4, max_pos=40)
    angles = np.arange(40, dtype=np.float32)[:, None] * c.inv_freq[None, :]
    np.testing.assert_allclose(read(cl_dev, c.rope_cs, (40, head_dim)),
                               np.concatenate([np.cos(angles), np.sin(angles)], 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [TINY, MODEL, dict(MODEL, block_size=8), HEAD12, HEAD32],
                         ids=["tiny", "model", "model-bs8", "head12", "head32"])
def test_decode_attention_matches_numpy(cl_dev, shape):
    """A batch of sequences whose contexts differ (1 token, block-size multiples and not, past
    several 16-position tiles), scattered blocks: each row ropes, writes and attends."""
    rng = np.random.default_rng(2)
    c = Case(cl_dev, **shape)
    bs = shape["block_size"]
    lengths = [0, 1, bs - 1, bs, bs + 1, 37, 50, 3]  # cached positions; the new token sits at pos = length
    tables = scattered_tables(rng, c.layout.num_blocks, lengths, bs, extra=1)
    c.fill_context(rng, 1, tables, lengths)
    seq_of_row, pos = np.arange(len(lengths)), np.array(lengths)
    qkv = c.qkv(rng, len(lengths))
    got, sums, pool, _ = c.run("decode", qkv, seq_of_row, pos, tables, layer=1)
    q, k, v = c.split(qkv)
    want_pool = c.image.copy()
    kv_write_ref(want_pool, 1, rope_ref(k, pos, c.inv_freq).astype(np.float32), v, seq_of_row, pos, tables)
    np.testing.assert_allclose(pool, want_pool, rtol=1e-5, atol=1e-6)
    assert np.array_equal(pool == POISON, want_pool == POISON)
    ref = attention_ref(rope_ref(q, pos, c.inv_freq), seq_of_row, pos, want_pool, 1, tables)
    np.testing.assert_allclose(got, ref.reshape(len(pos), -1), rtol=1e-4, atol=1e-5)
    if c.hd % 32 == 0:
        np.testing.assert_allclose(sums, got.reshape(len(pos), -1, 32).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [TINY, MODEL, HEAD12, HEAD32], ids=["tiny", "model", "head12", "head32"])
def test_prefill_chunk_attention_is_causal(cl_dev, shape):
    """Two sequences' chunks in one launch: C tokens at [start, start + C) over start cached ones.
    Matches the reference (which sees only [0, pos]), and changing a chunk's last token leaves
    every earlier row bit-identical."""
    rng = np.random.default_rng(3)
    c = Case(cl_dev, **shape)
    starts, chunks = [19, 0], [21, 6]
    tables = scattered_tables(rng, c.layout.num_blocks, [s + n for s, n in zip(starts, chunks)], shape["block_size"])
    c.fill_context(rng, 0, tables, starts)
    seq_of_row = np.concatenate([np.full(n, s) for s, n in enumerate(chunks)])
    pos = np.concatenate([np.arange(st, st + n) for st, n in zip(starts, chunks)])
    qkv = c.qkv(rng, len(pos))
    got, sums, pool, qkv_after = c.run("rope_store+attention", qkv, seq_of_row, pos, tables, layer=0)
    q, k, v = c.split(qkv)
    np.testing.assert_allclose(c.split(qkv_after)[0], rope_ref(q, pos, c.inv_freq), rtol=1e-5, atol=1e-6)
    want_pool = c.image.copy()
    kv_write_ref(want_pool, 0, rope_ref(k, pos, c.inv_freq).astype(np.float32), v, seq_of_row, pos, tables)
    np.testing.assert_allclose(pool, want_pool, rtol=1e-5, atol=1e-6)
    ref = attention_ref(rope_ref(q, pos, c.inv_freq), seq_of_row, pos, want_pool, 0, tables)
    np.testing.assert_allclose(got, ref.reshape(len(pos), -1), rtol=1e-4, atol=1e-5)
    if c.hd % 32 == 0:
        np.testing.assert_allclose(sums, got.reshape(len(pos), -1, 32).sum(-1), rtol=1e-5, atol=1e-5)

    last = chunks[0] - 1  # sequence 0's last chunk token: no earlier row may see it
    qkv[last] = c.qkv(rng, 1)[0]
    got2, _, _, _ = c.run("rope_store+attention", qkv, seq_of_row, pos, tables, layer=0)
    np.testing.assert_array_equal(got2[:last], got[:last])
    np.testing.assert_array_equal(got2[last + 1:], got[last + 1:])
    assert not np.array_equal(got2[last], got[last])


@pytest.mark.parametrize("kernel", ["decode", "rope_store+attention"])
def test_batch_invariance(cl_dev, kernel):
    """One sequence alone vs as the 6th of 8 (other lengths, its blocks moved to other, shuffled
    ids): its output rows and its written K/V are bit-identical."""
    rng = np.random.default_rng(4)
    c = Case(cl_dev, **MODEL, num_blocks=80)
    n_ctx, chunk = 45, 1 if kernel == "decode" else 7
    kv = rng.normal(size=(n_ctx, 2, c.n_kv, c.hd)).astype(np.float32)
    qkv_one = c.qkv(rng, chunk)
    pos_one = np.arange(n_ctx, n_ctx + chunk)

    alone_tables = [[0, 1, 2, 3]]
    kv_write_ref(c.image, 0, kv[:, 0], kv[:, 1], np.zeros(n_ctx, int), np.arange(n_ctx), alone_tables)
    alone, alone_sums, alone_pool, _ = c.run(kernel, qkv_one, np.zeros(chunk, int), pos_one, alone_tables, 0)

    lengths = [3, 70, 1, 16, 33, n_ctx, 100, 9]
    me = 5
    tables = scattered_tables(rng, c.layout.num_blocks, lengths, 16, extra=chunk)
    c.image[:] = POISON
    c.fill_context(rng, 0, tables, lengths)
    kv_write_ref(c.image, 0, kv[:, 0], kv[:, 1], np.full(n_ctx, me), np.arange(n_ctx), tables)
    if kernel == "decode":
        seq_of_row, pos = np.arange(8), np.array(lengths)
        qkv = c.qkv(rng, 8)
        qkv[me] = qkv_one[0]
        rows = [me]
    else:  # every sequence brings a chunk of its own size; ours in the middle of the launch
        sizes = [2, 5, 1, chunk, 3, chunk, 4, 1]
        seq_of_row = np.concatenate([np.full(n, s) for s, n in enumerate(sizes)])
        pos = np.concatenate([np.arange(lengths[s], lengths[s] + n) for s, n in enumerate(sizes)])
        qkv = c.qkv(rng, len(pos))
        rows = np.flatnonzero(seq_of_row == me)
        qkv[rows] = qkv_one
    got, sums, pool, _ = c.run(kernel, qkv, seq_of_row, pos, tables, 0)
    np.testing.assert_array_equal(got[rows], alone)
    np.testing.assert_array_equal(sums[rows], alone_sums)
    np.testing.assert_array_equal(gather_kv(pool, 0, tables[me], n_ctx + chunk),
                                  gather_kv(alone_pool, 0, alone_tables[0], n_ctx + chunk))


@pytest.mark.parametrize("shape", [MODEL, HEAD32], ids=["model", "head32"])
def test_the_scores_kernel_is_paged_attentions_bits_over_long_contexts(cl_dev, shape):
    """paged_attention_scores (one work-item per kv head, each score computed once) against
    paged_attention: chunks of several sequences in one launch, contexts past a thousand positions and
    off the 16-position tiles, the same output and block sums bit for bit. A CPU device with the
    model's shape takes it; a context too long for its local memory does not."""
    rng = np.random.default_rng(6)
    c = Case(cl_dev, **shape, num_blocks=200, max_pos=1400)
    starts, chunks = [1291, 0, 500, 31], [9, 16, 1, 17]
    tables = scattered_tables(rng, c.layout.num_blocks, [s + n for s, n in zip(starts, chunks)], 16)
    c.fill_context(rng, 0, tables, starts)
    c.fill_context(rng, 1, tables, starts)
    seq_of_row = np.concatenate([np.full(n, s) for s, n in enumerate(chunks)]).astype(np.int32)
    pos = np.concatenate([np.arange(st, st + n) for st, n in zip(starts, chunks)]).astype(np.int32)
    max_blocks = max(len(t) for t in tables)
    assert c.pa.scores_fit(max_blocks)  # PoCL: a CPU device
    assert not c.pa.scores_fit(cl_dev.device.local_mem_size // (4 * c.group * 16))  # a context past its memory
    qkv = c.qkv(rng, len(pos))
    n = len(pos)
    results = {}
    for scores in (True, False):
        pool = buf(cl_dev, c.image)
        qkv_b, sb, pb, tb = (buf(cl_dev, a) for a in (qkv, seq_of_row, pos, pack_block_tables(tables, max_blocks)))
        out = cl.Buffer(cl_dev.context, MF.READ_WRITE, n * c.q_dim * 4)
        sums = cl.Buffer(cl_dev.context, MF.READ_WRITE, n * c.q_dim // 32 * 4)
        c.pa.bind_rope_store(n, qkv_b, sb, pb, c.rope_cs, tb, max_blocks, pool, 1).enqueue(cl_dev.queue)
        c.pa.bind_attention(n, qkv_b, sb, pb, tb, max_blocks, pool, 1, out, sums, scores=scores).enqueue(cl_dev.queue)
        results[scores] = (read(cl_dev, out, (n, c.q_dim)), read(cl_dev, sums, (n, c.q_dim // 32)),
                           read(cl_dev, pool, c.layout.shape))
    np.testing.assert_array_equal(results[True][0], results[False][0])
    np.testing.assert_array_equal(results[True][1], results[False][1])
    q, _, _ = c.split(qkv)
    ref = attention_ref(rope_ref(q, pos, c.inv_freq), seq_of_row, pos, results[True][2], 1, tables)
    np.testing.assert_allclose(results[True][0], ref.reshape(n, -1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [MODEL, HEAD32], ids=["model", "head32"])
def test_the_decode_scores_kernel_is_the_decode_kernels_bits(cl_dev, shape):
    """paged_rope_attention_decode_scores (one work-item per kv head, each cached score computed once)
    against paged_rope_attention_decode: decode rows of several sequences at positions on and off the
    16-position tiles (0, 15, 16, 17, 500, 1291), the same output, block sums and written K/V bit for
    bit; and bind_decode takes it on a CPU device (PoCL) where the scores fit."""
    rng = np.random.default_rng(7)
    c = Case(cl_dev, **shape, num_blocks=200, max_pos=1400)
    lengths = [1291, 0, 500, 15, 16, 17]
    tables = scattered_tables(rng, c.layout.num_blocks, lengths, 16, extra=1)
    c.fill_context(rng, 1, tables, lengths)
    seq_of_row, pos = np.arange(len(lengths), dtype=np.int32), np.array(lengths, np.int32)
    max_blocks = max(len(t) for t in tables)
    assert c.pa.scores_fit(max_blocks)
    qkv = c.qkv(rng, len(pos))
    n = len(pos)
    results = {}
    for scores in (None, False):  # None: bind_decode's own choice
        pool = buf(cl_dev, c.image)
        qkv_b, sb, pb, tb = (buf(cl_dev, a) for a in (qkv, seq_of_row, pos, pack_block_tables(tables, max_blocks)))
        out = cl.Buffer(cl_dev.context, MF.READ_WRITE, n * c.q_dim * 4)
        sums = cl.Buffer(cl_dev.context, MF.READ_WRITE, n * c.q_dim // 32 * 4)
        launch = c.pa.bind_decode(n, qkv_b, sb, pb, c.rope_cs, tb, max_blocks, pool, 1, out, sums, scores=scores)
        # the scores kernel runs a work-item per kv head, the other one per query head
        assert launch.global_size == (n, c.n_kv if scores is None else c.n_heads)
        launch.enqueue(cl_dev.queue)
        results[scores] = (read(cl_dev, out, (n, c.q_dim)), read(cl_dev, sums, (n, c.q_dim // 32)),
                           read(cl_dev, pool, c.layout.shape))
    for got, want in zip(results[None], results[False]):
        np.testing.assert_array_equal(got, want)
    q, _, _ = c.split(qkv)
    ref = attention_ref(rope_ref(q, pos, c.inv_freq), seq_of_row, pos, results[None][2], 1, tables)
    np.testing.assert_allclose(results[None][0], ref.reshape(n, -1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [TINY, MODEL, HEAD32, HEAD12], ids=["tiny", "model", "head32", "head12"])
def test_a_chunks_rows_are_the_decode_rows_bits(cl_dev, shape):
    """A chunk's row at position p gives what decoding that token at p gives, bit for bit, on and off the
    16-position tiles (p = 15, 31, 47 close one): speculation verifies drafts as a chunk, and a verify
    row whose attention rounds otherwise than the decode step parts the tokens, most under int8
    activations, which turn an ulp into a quantization step (issue 56)."""
    rng = np.random.default_rng(8)
    c = Case(cl_dev, **shape, num_blocks=80)
    start, chunk = 13, 36  # positions 13..48
    tables = scattered_tables(rng, c.layout.num_blocks, [start + chunk], shape["block_size"])
    c.fill_context(rng, 0, tables, [start])
    qkv = c.qkv(rng, chunk)
    pos = np.arange(start, start + chunk)
    got, sums, pool, _ = c.run("rope_store+attention", qkv, np.zeros(chunk, int), pos, tables, 0)
    image = c.image.copy()
    for i, p in enumerate(pos):  # the same tokens decoded one at a time
        one, one_sums, image, _ = c.run("decode", qkv[i:i + 1], np.zeros(1, int), np.array([p]), tables, 0, image)
        np.testing.assert_array_equal(got[i], one[0], err_msg=f"position {p}")
        if c.hd % 32 == 0:  # the kernels write block sums only then
            np.testing.assert_array_equal(sums[i], one_sums[0], err_msg=f"position {p}")
    np.testing.assert_array_equal(pool, image)
