"""Decode ms/token of a Q4_K_M file on the OpenCL engine: its K-quant and 5-bit device kernels
against the f32 fallback every such type had before them.

The file is the default model requantized by llama.cpp's `llama-quantize ... Q4_K_M` (its rows,
576 and 1536 wide, are not all multiples of 256, so it holds Q5_0, Q4_K, Q6_K and Q8_0 matrices).
Rows, each an OpenCLEngine on that one file, the paged step (the serving path) with greedy picks:
  * kquant       gguf storage: every matrix in its own block format (Q5_0 beside Q8_0 in a q|k|v
                 stack as Q8_0, the same weights)
  * f32-fallback gguf storage as it was: Q4_0/Q4_1/Q8_0 blocks, every other type and every stack
                 of mixed types dequantized to f32 (HYBRIDSERVE_DECODE_ALLOW_DENSE_FALLBACK's path)
  * q4_1-file    the shipped Q4_1 file, for scale (its layers one format: one launch at batch 1)
Batch 1 and 8 at a context of --context tokens (random KV, imported), interleaved round by round,
medians of every round's steps.

    python -m bench.micro.kquant_decode --quantize PATH/TO/llama-quantize [--rounds N] [--steps N]
    python -m bench.micro.kquant_decode --gguf PATH/TO/model.Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from bench._common import progress, stats, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

BATCHES = (1, 8)
OLD_KERNELS = ("q4_0", "q4_1", "q8_0", "f16", "f32")  # the device formats before the K-quant kernels


def quantize_default(quantize: str, out_dir: Path) -> Path:
    """The default model requantized to Q4_K_M by llama.cpp's own tool."""
    from services.model.checkpoint import default_checkpoint_path

    src = default_checkpoint_path()
    out = out_dir / (src.name.split(".Q4_1")[0] + ".Q4_K_M.gguf")
    if not out.exists():
        progress(f"llama-quantize {src.name} -> {out.name}")
        done = subprocess.run([quantize, "--allow-requantize", str(src), str(out), "Q4_K_M"], capture_output=True,
                              text=True)
        if done.returncode:
            raise SystemExit(f"llama-quantize failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return out


def as_before(blocks: dict) -> dict:
    """The blocks the engine read before the K-quant kernels: other types dequantized to f32."""
    from services.model.gguf_blocks import BlockTensor

    out = {}
    for name, t in blocks.items():
        if t.qtype not in OLD_KERNELS:
            dense = np.ascontiguousarray(t.dequantize(), np.float32)
            t = BlockTensor(name, "f32", t.rows, t.cols, dense.view(np.uint8).reshape(t.rows, -1), t.source)
        out[name] = t
    return out


def engines(gguf: Path, max_batch: int, max_context: int) -> dict:
    from services.decode_fpga.config import EngineConfig
    from services.decode_fpga.device import select_device
    from services.decode_fpga.engine import OpenCLEngine
    from services.model.gguf_blocks import read_block_tensors
    from services.model.loading import load_model

    dev = select_device()
    common = dict(weights_dtype="gguf", max_context=max_context, kv_cache_mb=256)
    out = {}
    kq = load_model(str(gguf))
    blocks = read_block_tensors(kq.checkpoint, kq.config)
    out["kquant"] = OpenCLEngine.create(kq.config, kq.weights, dev, EngineConfig(**common), blocks)
    out["f32-fallback"] = OpenCLEngine.create(kq.config, kq.weights, dev,
                                              EngineConfig(**common, allow_dense_fallback=True), as_before(blocks))
    shipped = load_model()
    out["q4_1-file"] = OpenCLEngine.create(shipped.config, shipped.weights, dev, EngineConfig(**common),
                                           read_block_tensors(shipped.checkpoint, shipped.config))
    return out


def main() -> int:
    from bench.micro.paged_step import time_paged_wall

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="a Q4_K_M file of the default model")
    src.add_argument("--quantize", help="llama.cpp's llama-quantize, to make that file from the default model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="timed steps per engine, batch and round")
    ap.add_argument("--context", type=int, default=128)
    args = ap.parse_args()
    gguf = Path(args.gguf) if args.gguf else quantize_default(args.quantize, Path(tempfile.gettempdir()))
    engs = engines(gguf, max(BATCHES), args.context + args.steps + 8)
    load_before = os.getloadavg()  # the machine is shared: say how busy it was
    cells: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        progress(f"round {r + 1}/{args.rounds}")
        for batch in BATCHES:
            for name, eng in engs.items():
                cells.setdefault((name, batch), []).extend(
                    time_paged_wall(eng, eng.cfg, batch, args.context, args.steps))
    rows, lines = [], []
    for name, eng in engs.items():
        row = [name, f"{eng.weights_nbytes / 1e6:.1f}", eng.weights.storage_summary()]
        for batch in BATCHES:
            ms = stats([x * 1e3 for x in cells[(name, batch)]])
            row.append(ms["median"])
            lines.append({"engine": name, "batch": batch, "context": args.context, "ms_per_step": ms,
                          "weights_mb_per_step": eng.weights_nbytes / 1e6,
                          "stored_weight_types": eng.stored_weight_types, "storage": eng.weights.storage_summary()})
        rows.append(row)
    print(table(["engine", "MB/step", "stored (file type→device)", *(f"b{b} ms/step" for b in BATCHES)], rows))
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}; medians of {args.rounds} rounds "
          f"x {args.steps} steps, context {args.context}")
    write_json("kquant_decode", {"gguf": gguf.name, "rounds": args.rounds, "steps": args.steps,
                                 "loadavg_before": load_before, "loadavg_after": load_after,
                                 "device": next(iter(engs.values())).device_name, "lines": lines})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
