"""Paged decode attention (kernels/paged_attention.cl): achieved GB/s on the model's attention shape.
(Its comparison with the slot path's contiguous kernel ended with that kernel, commit history of
issue 54: the paged one read 16-token blocks shuffled over the pool at the contiguous one's speed.)

SmolLM2-135M's heads (9 query, 3 KV, dim 64), blocks of 16 tokens scattered in random order
over the pool. One decode step's attention: every sequence of the batch at the same context,
one launch per layer over `layers` distinct layers in turn (one layer's KV alone would sit in
the caches and flatter both kernels), one wait per step. GB/s = K and V bytes the step reads
(layers * batch * 2 * kv_heads * context * head_dim * 4) / time of the step; medians of
several steps. Besides 16-token blocks shuffled over the pool (the serving case), the same
blocks in order and 64-token blocks shuffled, to tell the table's cost from the scattering's.

--prefill: a prefill chunk's attention instead (the rows of one sequence at the end of its context,
over 30 layers, blocks shuffled): paged_attention (one work-item per query head) against
paged_attention_scores (one per kv head, each score once), interleaved round by round, ms per step
and per row, and whether their outputs are the same bits (an md5 of each one's output and sums).

--decode: a decode step's attention the same way (sequences at one context, their new tokens roped and
written by the kernel): paged_rope_attention_decode (one work-item per query head, each score computed
twice) against paged_rope_attention_decode_scores (one per kv head, each score once).

    python -m bench.micro.paged_attention [--steps N] [--quick] [--prefill | --decode [--rounds N]]
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import time

from bench._common import progress, table, write_json

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402

from services.decode_fpga.device import select_device  # noqa: E402
from services.decode_fpga.paged_attention import PagedAttention, PagedKVLayout, pack_block_tables  # noqa: E402

MF = cl.mem_flags
N_HEADS, N_KV, HEAD_DIM, BLOCK = 9, 3, 64, 16
KV_BUDGET = 400 << 20  # bytes of KV per kernel: as many layers as fit, at most 30


def timed(queue, launches, steps: int) -> float:
    """Median seconds of one step (every launch once, one wait)."""
    for launch in launches:  # warm-up (and first-touch of the buffers)
        launch.enqueue(queue)
    queue.finish()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for launch in launches:
            launch.enqueue(queue)
        queue.finish()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# paged variants: (name, block size, blocks shuffled over the pool or in order)
VARIANTS = (("paged", 16, True), ("paged_in_order", 16, False), ("paged_bs64", 64, True))


def rope_table(dev, pa: PagedAttention, ctx: int) -> cl.Buffer:
    """The cos | sin table of positions [0, ctx) for the model's heads (paged_attention.cl's rope_table)."""
    inv_freq = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR,
                         hostbuf=(1.0 / (1e4 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))).astype(np.float32))
    rope_cs = cl.Buffer(dev.context, MF.READ_WRITE, ctx * HEAD_DIM * 4)
    pa.bind_rope_table(ctx, inv_freq, rope_cs).enqueue(dev.queue)
    dev.queue.finish()  # inv_freq is released on return: the table must be written before
    return rope_cs


def measure(dev, ctx: int, batch: int, steps: int, rng) -> dict:
    per_layer = batch * 2 * N_KV * ctx * HEAD_DIM * 4
    layers = max(1, min(30, KV_BUDGET // per_layer))
    q_dim, kv_dim = N_HEADS * HEAD_DIM, N_KV * HEAD_DIM
    qkv = cl.Buffer(dev.context, MF.READ_WRITE | MF.COPY_HOST_PTR,
                    hostbuf=rng.normal(size=(batch, q_dim + 2 * kv_dim)).astype(np.float32))
    pos = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.full(batch, ctx - 1, np.int32))
    seqs = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.arange(batch, dtype=np.int32))
    out = cl.Buffer(dev.context, MF.READ_WRITE, batch * q_dim * 4)
    sums = cl.Buffer(dev.context, MF.READ_WRITE, batch * q_dim // 32 * 4)
    rope_cs = None
    row = {"context": ctx, "batch": batch, "layers": layers}
    kernels = []
    for name, block, shuffled in VARIANTS:  # the same contexts in blocks
        max_blocks = -(-ctx // block)
        layout = PagedKVLayout(layers, N_KV, HEAD_DIM, block, batch * max_blocks)
        order = rng.permutation(layout.num_blocks) if shuffled else np.arange(layout.num_blocks)
        tables = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR,
                           hostbuf=pack_block_tables(order.reshape(batch, max_blocks), max_blocks))
        pool = layout.allocate(dev)
        cl.enqueue_fill_buffer(dev.queue, pool, np.float32(0.01), 0, layout.nbytes)
        pa = PagedAttention(dev, layout, N_HEADS)
        rope_cs = rope_cs or rope_table(dev, pa, ctx)
        kernels.append((name, [pa.bind_decode(batch, qkv, seqs, pos, rope_cs, tables, max_blocks, pool, layer, out,
                                              sums) for layer in range(layers)], (pool, tables)))
    for name, launches, _held in kernels:  # _held: buffers alive until their launches ran
        sec = timed(dev.queue, launches, steps)
        row[name] = {"us_per_layer": sec / layers * 1e6, "gb_s": per_layer * layers / sec / 1e9}
    return row


PREFILL_CASES = ((256, 16), (1000, 16), (2000, 4), (2000, 16), (2000, 64))  # (context, chunk rows)
DECODE_CASES = ((128, 1), (512, 1), (512, 8), (1024, 4), (1024, 8), (2000, 8))  # (context, sequences)
# the two kernels of each kind, by bind_attention's / bind_decode's `scores`
KERNELS = {"prefill": {"paged_attention": False, "paged_attention_scores": True},
           "decode": {"paged_rope_attention_decode": False, "paged_rope_attention_decode_scores": True}}


def measure_pair(dev, kind: str, ctx: int, rows: int, rounds: int, rng) -> dict:
    """The two kernels of `kind` over 30 layers, interleaved round by round. prefill: a chunk of `rows`
    tokens ending at position ctx - 1, its K and V already in the pool; decode: `rows` sequences, each
    one's new token at position ctx - 1 (written by the kernel, the same values every time)."""
    layers, q_dim, kv_dim = 30, N_HEADS * HEAD_DIM, N_KV * HEAD_DIM
    max_blocks = -(-ctx // BLOCK)
    n_seqs = rows if kind == "decode" else 1
    qkv = cl.Buffer(dev.context, MF.READ_WRITE | MF.COPY_HOST_PTR,
                    hostbuf=rng.normal(size=(rows, q_dim + 2 * kv_dim)).astype(np.float32))
    positions = np.full(rows, ctx - 1, np.int32) if kind == "decode" else np.arange(ctx - rows, ctx, dtype=np.int32)
    pos = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=positions)
    seqs = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR,
                     hostbuf=np.arange(rows, dtype=np.int32) if kind == "decode" else np.zeros(rows, np.int32))
    layout = PagedKVLayout(layers, N_KV, HEAD_DIM, BLOCK, n_seqs * max_blocks + 8)
    tables = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=pack_block_tables(
        rng.permutation(layout.num_blocks)[:n_seqs * max_blocks].reshape(n_seqs, max_blocks), max_blocks))
    pool = layout.allocate(dev)
    cl.enqueue_copy(dev.queue, pool, (rng.normal(size=layout.nbytes // 4) * 0.5).astype(np.float32))
    pa = PagedAttention(dev, layout, N_HEADS)
    rope_cs = rope_table(dev, pa, ctx) if kind == "decode" else None  # the decode kernels rope
    runs = {}
    for name, scores in KERNELS[kind].items():
        out = cl.Buffer(dev.context, MF.READ_WRITE, rows * q_dim * 4)
        sums = cl.Buffer(dev.context, MF.READ_WRITE, rows * q_dim // 32 * 4)
        if kind == "decode":
            launches = [pa.bind_decode(rows, qkv, seqs, pos, rope_cs, tables, max_blocks, pool, layer, out, sums,
                                       scores=scores) for layer in range(layers)]
        else:
            launches = [pa.bind_attention(rows, qkv, seqs, pos, tables, max_blocks, pool, layer, out, sums,
                                          scores=scores) for layer in range(layers)]
        for launch in launches:  # its output, to compare (and the warm-up)
            launch.enqueue(dev.queue)
        o, s = np.empty(rows * q_dim, np.float32), np.empty(rows * q_dim // 32, np.float32)
        cl.enqueue_copy(dev.queue, o, out)
        cl.enqueue_copy(dev.queue, s, sums, is_blocking=True)
        runs[name] = {"launches": launches, "held": (out, sums), "times": [],
                      "md5": hashlib.md5(o.tobytes() + s.tobytes()).hexdigest()}
    for _ in range(rounds):  # interleaved: a busy moment of the machine hits both
        for run in runs.values():
            run["times"].append(timed(dev.queue, run["launches"], 3))
    row = {"context": ctx, "rows": rows, "layers": layers,
           "same_bits": len({r["md5"] for r in runs.values()}) == 1}
    for name, run in runs.items():
        ms = statistics.median(run["times"]) * 1e3
        row[name] = {"ms_per_step": ms, "ms_per_row": ms / rows, "rounds_ms": [t * 1e3 for t in run["times"]]}
    return row


def pair_main(args, kind: str) -> None:
    dev = select_device()
    rng = np.random.default_rng(0)
    cases = PREFILL_CASES if kind == "prefill" else DECODE_CASES
    cases = cases[:2] if args.quick else cases
    rows = []
    for ctx, n in cases:
        progress(f"{kind}: context {ctx}, {n} rows")
        rows.append(measure_pair(dev, kind, ctx, n, args.rounds, rng))
    old, new = KERNELS[kind]
    print(table(["context", "rows", f"{old} ms", f"{new} ms", "speedup", "same bits"],
                [[r["context"], r["rows"], f'{r[old]["ms_per_step"]:.2f}', f'{r[new]["ms_per_step"]:.2f}',
                  f'{r[old]["ms_per_step"] / r[new]["ms_per_step"]:.2f}x', r["same_bits"]] for r in rows]))
    write_json(f"paged_attention_{kind}", {"device": dev.name, "n_heads": N_HEADS, "n_kv_heads": N_KV,
                                           "head_dim": HEAD_DIM, "block_size": BLOCK, "rounds": args.rounds,
                                           "rows": rows})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="context 64 and 512 only, 5 steps")
    ap.add_argument("--prefill", action="store_true", help="a prefill chunk's attention, the two kernels")
    ap.add_argument("--decode", action="store_true", help="a decode step's attention, the two kernels")
    ap.add_argument("--rounds", type=int, default=12, help="--prefill, --decode: interleaved rounds")
    args = ap.parse_args()
    if args.prefill or args.decode:
        return pair_main(args, "prefill" if args.prefill else "decode")
    dev = select_device()
    rng = np.random.default_rng(0)
    contexts = (64, 512) if args.quick else (64, 512, 2048)
    steps = 5 if args.quick else args.steps
    rows = []
    for ctx in contexts:
        for batch in (1, 8):
            progress(f"context {ctx}, batch {batch}")
            rows.append(measure(dev, ctx, batch, steps, rng))
    names = [v[0] for v in VARIANTS]
    print(table(["context", "batch", "layers"] + [f"{n} us/layer (GB/s)" for n in names],
                [[r["context"], r["batch"], r["layers"]]
                 + [f'{r[n]["us_per_layer"]:.1f} ({r[n]["gb_s"]:.1f})' for n in names] for r in rows]))
    write_json("paged_attention", {"device": dev.name, "n_heads": N_HEADS, "n_kv_heads": N_KV,
                                   "head_dim": HEAD_DIM, "block_size": BLOCK, "steps": steps, "rows": rows})


if __name__ == "__main__":
    main()
