"""Block-format GEMV (kernels/gemv_quant.cl): achieved GB/s per format on the model's shapes.

(fp16 lines: the dense kernel on the same weights, as a yardstick measured in the same run.)

GB/s = bytes of blocks on the device (scales + mins + quants) / time per launch. Each
shape is 30 distinct matrices launched in turn (as a decode step does: one 576x576
Q4_1 matrix alone fits in the caches and would flatter the kernel); the LM head is
one. Medians of several runs, with numpy memory bandwidth measured in the same run.
The checkpoint's own tensors where it has the format (Q4_1 layers, Q8_0 head),
gguf-quantized random weights otherwise (speed does not depend on the values).

    python bench/quant_gemv.py [--runs N] [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from _common import RESULTS, memory_bandwidth_gbs, progress, stats, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402

MF = cl.mem_flags
FORMATS = ("q4_0", "q4_1", "q8_0", "fp16")  # fp16: the dense kernel (gemv.cl), for scale


def read_bandwidth_gbs(mb: int = 512, reps: int = 5) -> float:
    """numpy sum over a buffer much larger than the caches: bytes read / time, median."""
    a = np.ones(mb << 18, np.float32)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t)
    return a.nbytes / statistics.median(times) / 1e9


def synthetic(qtype: str, rows: int, cols: int, seed: int):
    import gguf
    from gguf.quants import quantize

    from services.model.gguf_blocks import BlockTensor

    w = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32) * 0.05
    raw = quantize(w, gguf.GGMLQuantizationType[qtype.upper()]).reshape(rows, -1)
    return BlockTensor(f"synthetic {qtype}", qtype, rows, cols, raw)


def shapes(blocks, cfg, quick: bool) -> dict[str, tuple[int, int, int, callable]]:
    """shape name → (rows, cols, copies, real tensor of layer i), the tensors as the engine assembles them."""
    from services.decode_fpga.device_weights import gguf_layer_tensors, gguf_lm_head_tensor

    n = 4 if quick else cfg.n_layers
    h, ff = cfg.hidden, cfg.intermediate
    return {"o": (h, cfg.q_dim, n, lambda i: gguf_layer_tensors(blocks, i)["o"]),
            "qkv": (cfg.q_dim + 2 * cfg.kv_dim, h, n, lambda i: gguf_layer_tensors(blocks, i)["qkv"]),
            "gate_up": (2 * ff, h, n, lambda i: gguf_layer_tensors(blocks, i)["gate_up"]),
            "down": (h, ff, n, lambda i: gguf_layer_tensors(blocks, i)["down"]),
            "lm_head": (cfg.vocab_size, h, 1, lambda i: gguf_lm_head_tensor(blocks))}


def time_launches(dev, mats, x, y, batch: int, reps: int) -> float:
    """Seconds per launch: every matrix in turn, `reps` times, one wait at the end. Launches are
    bound once, as the engine does (binding costs ~40 us of Python per launch)."""
    sums = cl.Buffer(dev.context, MF.READ_WRITE, batch * mats[0].cols // 32 * 4)  # x's block sums (Q4_1)
    launches = [m.bind_gemv(x, y, batch, x_sums=sums) for m in mats]
    for la in launches:
        la.enqueue(dev.queue)
    dev.queue.finish()
    t = time.perf_counter()
    for _ in range(reps):
        for la in launches:
            la.enqueue(dev.queue)
    dev.queue.finish()
    return (time.perf_counter() - t) / (reps * len(mats))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="4 layers, 3 runs, batch 1 and 8")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    runs = 3 if args.quick else args.runs

    from services.model.checkpoint import locate
    from services.decode_fpga.device import select_device
    from services.decode_fpga.gemv import upload_dense_matrix
    from services.decode_fpga.quant_gemv import QuantMatrix
    from services.model.config import read_config
    from services.model.gguf_blocks import read_block_tensors

    ckpt = locate()
    cfg = read_config(ckpt)
    src = read_block_tensors(ckpt, cfg)
    dev = select_device()
    progress(f"block GEMV on {dev.name}")
    x = cl.Buffer(dev.context, MF.READ_WRITE, 16 * max(cfg.intermediate, cfg.hidden) * 4)
    y = cl.Buffer(dev.context, MF.READ_WRITE, 16 * cfg.vocab_size * 4)
    cl.enqueue_fill_buffer(dev.queue, x, np.float32(0.01), 0, 16 * max(cfg.intermediate, cfg.hidden) * 4)
    lines, bw_copy, bw_read = [], [], []
    for shape, (rows, cols, copies, real) in shapes(src, cfg, args.quick).items():
        for fmt in FORMATS:
            if fmt == "fp16":
                use_real = True
                mats = [upload_dense_matrix(dev, real(i).dequantize(), "fp16") for i in range(copies)]
            else:
                use_real = real(0).qtype == fmt
                ts = [real(i) if use_real else synthetic(fmt, rows, cols, i) for i in range(copies)]
                mats = [QuantMatrix(dev, t) for t in ts]
            for batch in (1, 8):
                reps = max(2, int(2e6 // (mats[0].nbytes * batch ** 0.5)) // copies)
                times = []
                for _ in range(runs):
                    times.append(time_launches(dev, mats, x, y, batch, reps))
                st = stats(times)
                gbs = mats[0].nbytes / st["median"] / 1e9
                lines.append({"shape": shape, "rows": rows, "cols": cols, "format": fmt, "batch": batch,
                              "real_tensors": use_real, "matrices": copies, "bytes": mats[0].nbytes,
                              "us_median": st["median"] * 1e6, "us_min": st["min"] * 1e6, "us_max": st["max"] * 1e6,
                              "gbs": gbs})
                progress(f"{shape} {rows}x{cols} {fmt} b{batch}: {st['median'] * 1e6:.1f} us, {gbs:.1f} GB/s")
            del mats
        bw_copy.append(memory_bandwidth_gbs(256, 3))
        bw_read.append(read_bandwidth_gbs(256, 3))
    copy_gbs, read_gbs = statistics.median(bw_copy), statistics.median(bw_read)
    print(table(["shape", "rows x cols", "format", "batch", "KB", "us (median)", "us min-max", "GB/s"],
                [[ln["shape"] + ("" if ln["real_tensors"] else "*"), f"{ln['rows']}x{ln['cols']}", ln["format"],
                  ln["batch"], f"{ln['bytes'] / 1e3:.0f}", f"{ln['us_median']:.1f}",
                  f"{ln['us_min']:.1f}-{ln['us_max']:.1f}", f"{ln['gbs']:.1f}"] for ln in lines]))
    print(f"* gguf-quantized random weights (the checkpoint has no tensor of that format and shape)\n"
          f"numpy memory bandwidth in this run: copy (read+write) {copy_gbs:.1f} GB/s, read (sum) {read_gbs:.1f} GB/s; "
          f"medians of {runs} runs")
    write_json("quant_gemv", {"device": dev.name, "memory_bandwidth_copy_gbs": bw_copy,
                              "memory_bandwidth_read_gbs": bw_read, "runs": runs, "lines": lines},
               out_dir=Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
