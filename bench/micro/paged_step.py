"""The OpenCL engine's paged step (continuous batching): ms per step and per row at batch 1-64, against
the memory-bandwidth limit, with the batched GEMV kernels side by side.

Rows, gguf weights, every row a decode at a context of --contexts tokens (random KV, imported: a
step's cost does not depend on its values):
  * paged tile=T  OpenCLEngine.step over the paged pool, greedy, with the batched block GEMVs at
                  opencl_gemv_tile T (0: gemv_quant_rows, one output row a work-item, the kernel
                  before; 2: gemv_quant_tiles past the rows whose x fills L1). At batch 1 the step
                  runs as one launch (paged_decode_layers) when the engine's choice says so.
Interleaved round by round, medians of every round's steps. Per row: ms per step / batch. Limit: the
bytes of weights a step reads (as the device stores them) / the machine's memory bandwidth
(_common.memory_bandwidth_gbs: a numpy copy, read + write; the better of a measure before and after).
Also the process's CPU seconds per step (both cores' work; on a shared machine the steadier figure).

    python -m bench.micro.paged_step [--rounds N] [--steps N] [--batches 1,2,4,...] [--gemv-tiles 0,2]
                               [--contexts 128] [--model PATH.gguf] [--name paged_step]
"""
from __future__ import annotations

import argparse
import os
import time

from bench._common import memory_bandwidth_gbs, progress, stats, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def engines(model: str | None, tiles: tuple[int, ...], max_batch: int, max_context: int):
    """The model and one engine per GEMV tile."""
    from services.decode_fpga.config import EngineConfig
    from services.decode_fpga.device import select_device
    from services.decode_fpga.engine import OpenCLEngine
    from services.model.gguf_blocks import read_block_tensors
    from services.model.loading import load_model

    loaded = load_model(model) if model else load_model()
    cfg = loaded.config
    blocks = read_block_tensors(loaded.checkpoint, cfg)
    # the pool the largest batch needs (4 bytes a value, K and V, every layer), with room to spare
    blocks_per_seq = -(-max_context // 16) + 1
    kv_mb = int(max_batch * blocks_per_seq * 16 * cfg.n_layers * 2 * cfg.kv_dim * 4 / 2**20 * 1.2) + 16
    common = dict(weights_dtype="gguf", max_context=max_context, max_num_seqs=max(64, max_batch), kv_cache_mb=kv_mb)
    out = {f"paged tile={t}": OpenCLEngine.create(cfg, loaded.weights, select_device(gemv_tile=t),
                                                  EngineConfig(**common), blocks) for t in tiles}
    return cfg, loaded.checkpoint, out


def random_kv(cfg, ctx: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((cfg.n_layers, 2, cfg.n_kv_heads, ctx, cfg.head_dim),
                                                       dtype=np.float32) * 0.5


def time_paged_wall(engine, cfg, batch: int, ctx: int, steps: int) -> list[float]:
    """Wall seconds of each timed step (`time_paged` without its CPU times)."""
    return [wall for wall, _ in time_paged(engine, cfg, batch, ctx, steps)]


def time_paged(engine, cfg, batch: int, ctx: int, steps: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each timed step."""
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
        t, c = time.perf_counter(), time.process_time()
        tokens = engine.step(chunks, greedy=True)
        if i >= 2:
            times.append((time.perf_counter() - t, time.process_time() - c))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per configuration and round")
    ap.add_argument("--batches", type=ints, default=(1, 2, 4, 8, 16, 32, 64))
    ap.add_argument("--contexts", type=ints, default=(128,))
    ap.add_argument("--gemv-tiles", type=ints, default=(0, 2), help="opencl_gemv_tile values, side by side")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the packaged model)")
    ap.add_argument("--name", default="paged_step", help="bench/results/NAME.json")
    args = ap.parse_args()
    max_context = max(args.contexts) + args.steps + 8
    cfg, ckpt, engs = engines(args.model, args.gemv_tiles, max(args.batches), max_context)
    nbytes = next(iter(engs.values())).weights_nbytes
    bandwidth = [memory_bandwidth_gbs(256, 3)]
    cells: dict[tuple, list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        progress(f"round {r + 1}/{args.rounds}")
        for ctx in args.contexts:
            for batch in args.batches:
                for name, eng in engs.items():
                    cells.setdefault((name, ctx, batch), []).extend(time_paged(eng, cfg, batch, ctx, args.steps))
    bandwidth.append(memory_bandwidth_gbs(256, 3))
    gbs = max(bandwidth)
    limit_ms = nbytes / (gbs * 1e9) * 1e3
    rows, lines = [], []
    for ctx in args.contexts:
        for batch in args.batches:
            for name in engs:
                xs = cells.get((name, ctx, batch))
                if not xs:
                    continue
                wall = stats([w * 1e3 for w, _ in xs])
                cpu = stats([c * 1e3 for _, c in xs])
                rows.append([ctx, batch, name, wall["median"], wall["min"], wall["median"] / batch,
                             cpu["median"] / batch, limit_ms / batch, wall["median"] / limit_ms])
                lines.append({"path": name, "context": ctx, "batch": batch, "ms_per_step": wall,
                              "ms_per_row": wall["median"] / batch, "cpu_ms_per_step": cpu,
                              "cpu_ms_per_row": cpu["median"] / batch, "limit_ms_per_row": limit_ms / batch})
    print(table(["context", "batch", "path", "ms/step", "min", "ms/row", "cpu ms/row", "limit ms/row",
                 "x limit"], rows))
    print(f"limit: {nbytes / 1e6:.1f} MB of weights a step / {gbs:.1f} GB/s = {limit_ms:.2f} ms a step")
    write_json(args.name, {"rounds": args.rounds, "steps": args.steps, "device": next(iter(engs.values())).device_name,
                           "model": str(ckpt.path), "weights": "gguf", "weight_bytes_per_step": nbytes,
                           "memory_bandwidth_gbs": bandwidth, "limit_ms_per_step": limit_ms,
                           "load_average": os.getloadavg(), "lines": lines})


if __name__ == "__main__":
    main()
