"""The paged step's block GEMVs with int8 activations against the exact fp32 ones, on a model's own
matrices (default: the default model's), interleaved run by run in one process.

Per matrix kind (o, qkv, gate_up, down, lm_head; four layers' copies of each layer matrix) and rows of
x (1 and 8 by default): the process's CPU us per matrix per step (both PoCL threads' work; the
steadier figure on a shared machine) and wall us, for `fp32` (bind_gemv_rows on the exact device:
gemv_quant_tiles1/tiles) and `int8` (quantize_x8 + gemv_int8_rows, the quantization counted; the
quantize_x8 launch alone beside it).

With --formats (e.g. q4_0,q5_0,q5_k,q6_k) random matrices of each format at --shape (default a 1B
model's 2048x8192, four copies) take the model's place, and the memory's yardstick runs in the same
rounds (kquant_gemv.stream_read: stream_read.cl over ~40 MB); each GEMV's GB/s is its matrix's device
bytes over half its CPU time, as that file's. A K-quant matrix also runs `int8-kN` for each N of
--k-blocks (default 32,64: x quantized per N for the K-quants, int8_gemv.K_X_BLOCKS; 32 is the kernel
before per-256), in the same rounds.

    python -m bench.micro.int8_gemv [--model PATH.gguf | --formats F,F --shape RxC] [--rows 1,8] [--runs 7]
        [--k-blocks 32,64] [--name int8_gemv]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

from bench._common import progress, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402

MF = cl.mem_flags


def synthetic_kinds(formats: str, shape: str) -> dict:
    """{format: (rows, cols, copies, tensor i)}: random matrices, as kquant_gemv makes them."""
    from bench.micro.quant_gemv import synthetic  # gguf-py quantizes the legacy formats
    from tests.decode_fpga.kquant_checkpoint import random_blocks

    rows, cols = (int(v) for v in shape.split("x"))

    def make(fmt):
        return lambda i: (synthetic(fmt, rows, cols, i) if fmt in ("q4_0", "q4_1", "q8_0")
                          else random_blocks(fmt, rows, cols, seed=i))
    return {fmt: (rows, cols, 4, make(fmt)) for fmt in formats.split(",")}


def main() -> int:
    from bench.micro.kquant_gemv import stream_read
    from bench.micro.quant_gemv import shapes, time_rows
    from services.decode_fpga.int8_gemv import K_FORMATS, bind_int8_gemv_rows
    from services.decode_fpga.device import select_device
    from services.decode_fpga.quant_gemv import QuantMatrix
    from services.model.checkpoint import locate
    from services.model.config import read_config
    from services.model.gguf_blocks import read_block_tensors

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--formats", default="", help="random matrices of these formats instead of the model's")
    ap.add_argument("--shape", default="2048x8192", help="rows x cols of the --formats matrices")
    ap.add_argument("--k-blocks", default="32,64", help="also the K-quants with x quantized per these")
    ap.add_argument("--name", default="int8_gemv")
    args = ap.parse_args()
    rows_list = [int(v) for v in args.rows.split(",")]
    ckpt = locate(args.model)
    cfg = read_config(ckpt)
    src = read_block_tensors(ckpt, cfg)
    base = select_device()
    devs = {"fp32": base, "int8": dataclasses.replace(base, activations="int8")}
    top, width = max(rows_list), max(cfg.intermediate, cfg.hidden)
    x = cl.Buffer(base.context, MF.READ_WRITE, top * width * 4)
    sums = cl.Buffer(base.context, MF.READ_WRITE, top * width // 32 * 4)
    y = cl.Buffer(base.context, MF.READ_WRITE, top * cfg.vocab_size * 4)
    rng = np.random.default_rng(0)
    cl.enqueue_copy(base.queue, x, rng.normal(size=top * width).astype(np.float32), is_blocking=True)
    cl.enqueue_copy(base.queue, sums, rng.normal(size=top * width // 32).astype(np.float32), is_blocking=True)
    n_rows = cl.Buffer(base.context, MF.READ_WRITE, 4)
    lines = []
    kinds = shapes(src, cfg, True) if not args.formats else synthetic_kinds(args.formats, args.shape)
    if args.formats:
        width = max(width, int(args.shape.split("x")[1]))
        x = cl.Buffer(base.context, MF.READ_WRITE, top * width * 4)
        sums = cl.Buffer(base.context, MF.READ_WRITE, top * width // 32 * 4)
        y = cl.Buffer(base.context, MF.READ_WRITE, top * max(cfg.vocab_size, int(args.shape.split("x")[0])) * 4)
        cl.enqueue_copy(base.queue, x, rng.normal(size=top * width).astype(np.float32), is_blocking=True)
        cl.enqueue_copy(base.queue, sums, rng.normal(size=top * width // 32).astype(np.float32), is_blocking=True)
    read_runs: list[dict] = []
    for shape, (rows, cols, copies, real) in kinds.items():
        tensors = [real(i) for i in range(copies)]
        if not hasattr(tensors[0], "qtype"):
            progress(f"{shape}: mixed formats, skipped")
            continue
        held = {name: [QuantMatrix(dev, t) for t in tensors] for name, dev in devs.items()}  # kept alive
        launches = {name: [m.bind_gemv_rows(x, y, n_rows, x_sums=sums) for m in mats] for name, mats in held.items()}
        launches["quantize"] = [la.parts[0] for la in launches["int8"]]  # quantize_x8 alone, of the int8 figure
        for kb in filter(None, args.k_blocks.split(",")) if tensors[0].qtype in K_FORMATS else ():
            launches[f"int8-k{kb}"] = [bind_int8_gemv_rows(m, x, y, n_rows, False, sums, k_block=int(kb))
                                       for m in held["int8"]]
        nbytes = held["fp32"][0].nbytes
        reps = max(2, int(3e7 // (rows * cols * copies)))
        for n in rows_list:
            cl.enqueue_copy(base.queue, n_rows, np.array([n], np.int32), is_blocking=True)
            got: dict[str, list] = {name: [] for name in launches}
            for _ in range(args.runs):
                for name in launches:
                    got[name].append(time_rows(base, launches[name], n, reps))
                if args.formats:
                    read_runs.extend(ln for ln in stream_read(base, 1) if ln["format"] == "read")
            for name, runs in got.items():
                wall = statistics.median(w for w, _ in runs) / copies * 1e6
                cpu = statistics.median(c for _, c in runs) / copies * 1e6
                lines.append({"shape": shape, "rows": rows, "cols": cols, "fmt": tensors[0].qtype, "n": n,
                              "path": name, "wall_us": wall, "cpu_us": cpu, "runs": args.runs,
                              "device_bytes": nbytes, "gbs_at_cpu_per_2": nbytes / (cpu / 2) / 1e3})
        progress(f"{shape} done, load {os.getloadavg()[0]:.1f}")
    by = {(ln["shape"], ln["n"], ln["path"]): ln for ln in lines}
    out = []
    for (shape, n, path), ln in by.items():
        if not path.startswith("int8"):
            continue
        f, qz = by[(shape, n, "fp32")], by[(shape, n, "quantize")]
        out.append([shape, f"{ln['rows']}x{ln['cols']}", ln["fmt"], n, path, f"{f['cpu_us']:.0f}",
                    f"{ln['cpu_us']:.0f}",
                    f"{qz['cpu_us']:.0f}" if path == "int8" else "", f"{f['cpu_us'] / ln['cpu_us']:.2f}",
                    f"{f['gbs_at_cpu_per_2']:.1f}", f"{ln['gbs_at_cpu_per_2']:.1f}", f"{f['wall_us']:.0f}",
                    f"{ln['wall_us']:.0f}"])
    print(table(["matrix", "shape", "format", "rows of x", "path", "fp32 CPU us", "CPU us", "of it quantize",
                 "fp32/this", "fp32 GB/s", "GB/s", "fp32 wall us", "wall us"], out))
    read = None
    if read_runs:  # GB/s at CPU/2 of the yardstick, median over every round
        read = statistics.median(r["bytes"] / (r["cpu_us"] / 2) / 1e3 for r in read_runs)
        print(f"stream read: {read:.1f} GB/s at CPU/2 (median of {len(read_runs)} runs)")
    print(f"load average {os.getloadavg()}")
    write_json(args.name, {"model": ckpt.path.name, "lines": lines, "stream_read_gbs_at_cpu_per_2": read,
                           "stream_read_runs": read_runs, "loadavg_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
