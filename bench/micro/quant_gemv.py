"""Block-format GEMV (kernels/gemv_quant.cl): achieved GB/s per format on the model's shapes.

(fp16 lines: the dense kernel on the same weights, as a yardstick measured in the same run.)

GB/s = bytes of blocks on the device (scales + mins + quants) / time per launch. Each
shape is 30 distinct matrices launched in turn (as a decode step does: one 576x576
Q4_1 matrix alone fits in the caches and would flatter the kernel); the LM head is
one. Medians of several runs, with numpy memory bandwidth measured in the same run.
The checkpoint's own tensors where it has the format (Q4_1 layers, Q8_0 head),
gguf-quantized random weights otherwise (speed does not depend on the values).

    python -m bench.micro.quant_gemv [--runs N] [--quick]

--rows: the paged step's batched GEMVs instead (bind_gemv_rows: one output row a work-item, or tiles of
them past the rows whose x fills L1), per row of x at --batches, for each --gemv-tiles value side by
side (interleaved run by run), on the checkpoint's own matrices (--model: another GGUF file), all
layers: microseconds per row and matrix (the fastest run's wall time and its CPU time, both cores'
work: on a shared machine the steadier figure), and their sum over a step's matrices per row.

    python -m bench.micro.quant_gemv --rows [--batches 1,2,4,8,16,32,64] [--gemv-tiles 0,2] [--model F]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench._common import RESULTS, memory_bandwidth_gbs, progress, stats, table, write_json

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


def time_rows(dev, launches, n: int, reps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per step of `launches` (every matrix's batched GEMV) over n rows, one wait."""
    for la in launches:
        la.enqueue(dev.queue, 0, n)
    dev.queue.finish()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(reps):
        for la in launches:
            la.enqueue(dev.queue, 0, n)
    dev.queue.finish()
    return (time.perf_counter() - t) / reps, (time.process_time() - c) / reps


def batched(args) -> int:
    """--rows: the batched GEMVs per row of x, each GEMV tile side by side."""
    from services.decode_fpga.device import DeviceContext, select_device
    from services.decode_fpga.quant_gemv import QuantMatrix
    from services.model.checkpoint import locate
    from services.model.config import read_config
    from services.model.gguf_blocks import read_block_tensors

    ckpt = locate(args.model)
    cfg = read_config(ckpt)
    src = read_block_tensors(ckpt, cfg)
    base = select_device()  # one context and queue: each tile's matrices beside the others'
    devs = {t: DeviceContext(base.device, base.context, base.queue, gemv_tile=t) for t in args.gemv_tiles}
    progress(f"batched block GEMVs on {next(iter(devs.values())).name}, {ckpt.path.name}")
    width, top = max(cfg.intermediate, cfg.hidden), max(args.batches)
    lines, totals = [], {}
    for shape, (rows, cols, copies, real) in shapes(src, cfg, args.quick).items():
        tensors = [real(i) for i in range(copies)]
        if not hasattr(tensors[0], "qtype"):
            progress(f"{shape}: not one block format (mixed parts), skipped")
            continue
        per = {}
        for t, dev in devs.items():
            ctx = dev.context
            x = cl.Buffer(ctx, MF.READ_WRITE, top * width * 4)
            sums = cl.Buffer(ctx, MF.READ_WRITE, top * width // 32 * 4)
            y = cl.Buffer(ctx, MF.READ_WRITE, top * cfg.vocab_size * 4)
            cl.enqueue_copy(dev.queue, x, np.full(top * width, 0.01, np.float32), is_blocking=True)
            cl.enqueue_copy(dev.queue, sums, np.full(top * width // 32, 0.3, np.float32), is_blocking=True)
            n_rows = cl.Buffer(ctx, MF.READ_WRITE, 4)
            mats = [QuantMatrix(dev, ts) for ts in tensors]
            # the buffers are kept with the launches: a kernel's arguments do not keep them alive
            per[t] = (dev, n_rows, [m.bind_gemv_rows(x, y, n_rows, x_sums=sums) for m in mats], mats, (x, sums, y))
        nbytes = sum(m.nbytes for m in next(iter(per.values()))[3])
        for n in args.batches:
            for dev, n_rows, *_ in per.values():
                cl.enqueue_copy(dev.queue, n_rows, np.array([n], np.int32), is_blocking=True)
            reps = max(1, int(1e-2 / (nbytes / 20e9 * max(1.0, n / 4))))
            got = {t: [] for t in per}
            for _ in range(args.runs):
                for t, (dev, _, launches, *_) in per.items():
                    got[t].append(time_rows(dev, launches, n, reps))
            for t, runs in got.items():
                wall, cpu = min(w for w, _ in runs), min(c for _, c in runs)
                totals.setdefault((t, n), [0.0, 0.0])
                totals[(t, n)][0] += wall / n
                totals[(t, n)][1] += cpu / n
                lines.append({"shape": shape, "rows": rows, "cols": cols, "format": tensors[0].qtype,
                              "matrices": copies, "gemv_tile": t, "batch": n,
                              "us_per_row_matrix": wall / n / copies * 1e6,
                              "cpu_us_per_row_matrix": cpu / n / copies * 1e6})
                progress(f"{shape} {tensors[0].qtype} tile={t} b{n}: {wall / n / copies * 1e6:.1f} us/row "
                         f"(cpu {cpu / n / copies * 1e6:.1f})")
        del per
    tiles = list(devs)
    cell = {(x["shape"], x["gemv_tile"], x["batch"]): x for x in lines}
    kinds = dict.fromkeys((x["shape"], x["format"]) for x in lines)
    print(table(["shape", "format", "batch", *(f"tile={t} us/row" for t in tiles), *(f"tile={t} cpu" for t in tiles)],
                [[sh, fm, n, *(cell[(sh, t, n)]["us_per_row_matrix"] for t in tiles),
                  *(cell[(sh, t, n)]["cpu_us_per_row_matrix"] for t in tiles)]
                 for sh, fm in kinds for n in args.batches]))
    print("a step's GEMVs per row of x, ms (wall of the fastest runs; CPU):")
    print(table(["batch", *(f"tile={t} ms/row" for t in tiles), *(f"tile={t} cpu" for t in tiles)],
                [[n, *(totals[(t, n)][0] * 1e3 for t in tiles), *(totals[(t, n)][1] * 1e3 for t in tiles)]
                 for n in args.batches]))
    write_json(args.name, {"device": next(iter(devs.values())).name, "model": str(ckpt.path), "runs": args.runs,
                           "load_average": os.getloadavg(), "lines": lines,
                           "step_ms_per_row": [{"gemv_tile": t, "batch": n, "wall": totals[(t, n)][0] * 1e3,
                                                "cpu": totals[(t, n)][1] * 1e3} for t in tiles for n in args.batches]},
               out_dir=Path(args.out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="4 layers, 3 runs, batch 1 and 8")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--rows", action="store_true", help="the batched GEMVs of the paged step (see above)")
    ap.add_argument("--batches", type=lambda v: tuple(int(b) for b in v.split(",")), default=(1, 2, 4, 8, 16, 32, 64))
    ap.add_argument("--gemv-tiles", type=lambda v: tuple(int(b) for b in v.split(",")), default=(0, 2))
    ap.add_argument("--model", default=None, help="--rows: a GGUF file (default: the packaged model)")
    ap.add_argument("--name", default="quant_gemv_rows", help="--rows: bench/results/NAME.json")
    args = ap.parse_args()
    if args.rows:
        return batched(args)
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
