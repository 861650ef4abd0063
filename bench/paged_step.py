"""The OpenCL engine's paged step (continuous batching) against its slot path's decode steps.

ms per decode step at batch 1, 4, 8, 16 and a context of 128 and 512 tokens, gguf weights:
  * paged       OpenCLEngine.step over the paged pool, every row a decode, greedy (at batch 1 its
                one-launch layers, paged_decode_layers)
  * paged-LbL   the same launch by launch (an engine with layer_kernels off)
  * slot-1L     decode_greedy on slots, the one-launch layers (batch 1 only: decode_layers.cl)
  * slot-LbL    decode_greedy on slots, launch by launch
The KV is random (imported, not prefilled: a step's cost does not depend on its values).
Interleaved round by round, medians of every round's steps.

    python bench/paged_step.py [--rounds N] [--steps N]
"""
from __future__ import annotations

import argparse
import os
import time

from _common import progress, stats, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

BATCHES = (1, 4, 8, 16)
CONTEXTS = (128, 512)


def engines(max_batch: int, max_context: int):
    from services.decode_fpga.config import EngineConfig
    from services.decode_fpga.device import select_device
    from services.decode_fpga.engine import OpenCLEngine
    from services.model.gguf_blocks import read_block_tensors
    from services.model.loading import load_model

    loaded = load_model()
    cfg, dev = loaded.config, select_device()
    blocks = read_block_tensors(loaded.checkpoint, cfg)
    common = dict(weights_dtype="gguf", max_context=max_context, max_sequences=max_batch, kv_cache_mb=512)
    one = OpenCLEngine.create(cfg, loaded.weights, dev, EngineConfig(**common), blocks)
    lbl = OpenCLEngine.create(cfg, loaded.weights, dev, EngineConfig(**common, layer_kernels=False), blocks)
    return cfg, one, lbl


def random_kv(cfg, ctx: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((cfg.n_layers, 2, cfg.n_kv_heads, ctx, cfg.head_dim),
                                                       dtype=np.float32) * 0.5


def time_slot(engine, cfg, batch: int, ctx: int, steps: int) -> list[float]:
    seqs = [engine.new_sequence(ctx + steps + 4) for _ in range(batch)]
    try:
        kv = random_kv(cfg, ctx, batch)
        for s in seqs:
            for layer in range(cfg.n_layers):
                engine.import_kv_layer(s, layer, kv[layer])
            engine.finish_import(s, ctx)
        tokens, times = [7] * batch, []
        for i in range(steps + 2):
            t = time.perf_counter()
            tokens = engine.decode_greedy(seqs, tokens)
            if i >= 2:  # the first steps bind and warm up
                times.append(time.perf_counter() - t)
        return times
    finally:
        for s in seqs:
            engine.release(s)


def time_paged(engine, cfg, batch: int, ctx: int, steps: int) -> list[float]:
    from services.engine.scheduler import ScheduledChunk

    per_seq = -(-(ctx + steps + 4) // engine.block_size)
    ids = np.random.default_rng(ctx + batch).permutation(engine.num_blocks)[:batch * per_seq].tolist()
    tables = [tuple(ids[i * per_seq:(i + 1) * per_seq]) for i in range(batch)]
    kv = random_kv(cfg, ctx, batch)
    for table in tables:
        for layer in range(cfg.n_layers):
            engine.import_kv_blocks(table, layer, kv[layer])
    engine.finish_import_blocks()
    tokens, times = [7] * batch, []
    for i in range(steps + 2):
        chunks = [ScheduledChunk(b, ctx + i, (tokens[b],), tables[b], True, None) for b in range(batch)]
        t = time.perf_counter()
        tokens = engine.step(chunks, greedy=True)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per configuration and round")
    args = ap.parse_args()
    cfg, one, lbl = engines(max(BATCHES), max(CONTEXTS) + args.steps + 8)
    cells: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        progress(f"round {r + 1}/{args.rounds}")
        for ctx in CONTEXTS:
            for batch in BATCHES:
                runs = [("paged", lambda: time_paged(one, cfg, batch, ctx, args.steps)),
                        ("paged-LbL", lambda: time_paged(lbl, cfg, batch, ctx, args.steps)),
                        ("slot-LbL", lambda: time_slot(lbl, cfg, batch, ctx, args.steps))]
                if batch == 1:
                    runs.append(("slot-1L", lambda: time_slot(one, cfg, batch, ctx, args.steps)))
                for name, run in runs:
                    cells.setdefault((name, ctx, batch), []).extend(run())
    names = ["paged", "paged-LbL", "slot-1L", "slot-LbL"]
    rows, lines = [], []
    for ctx in CONTEXTS:
        for batch in BATCHES:
            row = [ctx, batch]
            for name in names:
                xs = cells.get((name, ctx, batch))
                row.append(stats(xs)["median"] * 1e3 if xs else "-")
                if xs:
                    lines.append({"path": name, "context": ctx, "batch": batch, "ms_per_step": stats([x * 1e3 for x in xs])})
            rows.append(row)
    print(table(["context", "batch", *(f"{n} ms" for n in names)], rows))
    write_json("paged_step", {"rounds": args.rounds, "steps": args.steps, "device": one.device_name,
                              "weights": "gguf", "lines": lines})


if __name__ == "__main__":
    main()
