"""A probe for issue 55's opt-in int8-activation path: one Q4_1 GEMV with x quantized to int8 per
block of 32 (bench/micro/int8_probe.cl: AVX2's vpmaddubsw and vpmaddwd through clang's builtins) against
the engine's fp32 kernel on the same matrices, interleaved run by run, in one process.

Not an engine path, and it says nothing yet about tokens: it measures what the integer products buy
on this device (CPU time per launch, both PoCL threads; GB/s of the matrix's device bytes at half
that time) and how far one GEMV's result moves (max error over float64 of gguf's weights times the
fp32 x, relative to the largest output). It also reports whether the device offers
cl_khr_integer_dot_product. Shapes: one matrix the caches hold (the arithmetic alone) and ~40 MB of
distinct 8192x2048 matrices (streamed from memory).

    python -m bench.micro.kquant_int8_probe [--runs N] [--name RESULTS_NAME]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from pathlib import Path

from bench._common import progress, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402

HERE = Path(__file__).resolve().parent
MF = cl.mem_flags
SHAPES = ((1024, 2048, 1), (8192, 2048, 0))  # rows, cols, copies (0: ~40 MB of them)


def cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 per block of 32 (round to nearest, the block's max to 127) and the blocks' scales."""
    xb = x.reshape(-1, 32)
    dx = (np.abs(xb).max(axis=1) / 127).astype(np.float32)
    safe = np.where(dx > 0, dx, 1)
    return np.clip(np.rint(xb / safe[:, None]), -127, 127).astype(np.int8).reshape(-1), dx


def measure(dev, rows: int, cols: int, copies: int, runs: int) -> list[dict]:
    import gguf
    from gguf.quants import dequantize
    from bench.micro.quant_gemv import synthetic

    from services.decode_fpga.quant_gemv import QuantMatrix

    ctx, queue = dev.context, dev.queue
    copies = copies or max(4, int(40e6 // (rows * cols * 0.7)))
    x = np.random.default_rng(0).normal(size=cols).astype(np.float32)
    xq, dx = quantize_x(x)

    def buf(a):
        return cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))

    xbuf, xqbuf, dxbuf, sbuf = buf(x), buf(xq), buf(dx), buf(x.reshape(-1, 32).sum(axis=1, dtype=np.float32))
    y = cl.Buffer(ctx, MF.READ_WRITE, rows * 4)
    program = cl.Program(ctx, (HERE / "int8_probe.cl").read_text()).build()
    ts = [synthetic("q4_1", rows, cols, i) for i in range(copies)]
    mats = [QuantMatrix(dev, t) for t in ts]
    fp32 = [m.bind_gemv(xbuf, y, 1, x_sums=sbuf) for m in mats]
    int8 = []
    for m in mats:
        k = cl.Kernel(program, "gemv_q4_1_int8")
        k.set_args(*m.device_arrays, xqbuf, dxbuf, sbuf, y, np.int32(cols))
        int8.append(k)
    paths = {"fp32": lambda: [la.enqueue(queue) for la in fp32],
             "int8": lambda: [cl.enqueue_nd_range_kernel(queue, k, (rows,), (1,)) for k in int8]}
    ref = dequantize(ts[0].raw, gguf.GGMLQuantizationType.Q4_1).reshape(rows, cols).astype(np.float64) @ x
    err = {}
    for name in paths:
        (fp32[0].enqueue(queue) if name == "fp32" else cl.enqueue_nd_range_kernel(queue, int8[0], (rows,), (1,)))
        out = np.empty(rows, np.float32)
        cl.enqueue_copy(queue, out, y)
        err[name] = float(np.abs(out - ref).max() / np.abs(ref).max())
    reps = max(2, int(4e6 // (rows * cols * 0.7)))
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(runs):
        for name, run in paths.items():
            run()
            queue.finish()
            c = cpu_seconds()
            for _ in range(reps):
                run()
            queue.finish()
            cpu[name].append((cpu_seconds() - c) / (reps * copies) * 1e6)
    return [{"path": name, "rows": rows, "cols": cols, "copies": copies, "bytes": mats[0].nbytes,
             "cpu_us_median": statistics.median(v), "cpu_us_min": min(v), "n": len(v),
             "gbs_at_cpu_per_2_threads": mats[0].nbytes / (statistics.median(v) / 2 * 1e-6) / 1e9,
             "rel_err_vs_float64": err[name]} for name, v in cpu.items()]


def main() -> int:
    from services.decode_fpga.device import select_device

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--name", default="kquant_int8_probe")
    args = ap.parse_args()
    dev = select_device()
    dot = "cl_khr_integer_dot_product" in dev.device.extensions
    lines = []
    for rows, cols, copies in SHAPES:
        progress(f"{rows}x{cols}")
        lines += measure(dev, rows, cols, copies, args.runs)
    print(table(["shape", "copies", "path", "CPU us (median)", "CPU us (min)", "GB/s at CPU/2", "rel. error"],
                [[f"{ln['rows']}x{ln['cols']}", ln["copies"], ln["path"], f"{ln['cpu_us_median']:.0f}",
                  f"{ln['cpu_us_min']:.0f}", f"{ln['gbs_at_cpu_per_2_threads']:.1f}",
                  f"{ln['rel_err_vs_float64']:.1e}"] for ln in lines]))
    print(f"device {dev.device.name!r}: cl_khr_integer_dot_product {'offered' if dot else 'not offered'}; "
          f"load average {os.getloadavg()}")
    write_json(args.name, {"device": dev.device.name, "integer_dot_product_extension": dot, "runs": args.runs,
                           "loadavg": os.getloadavg(), "lines": lines})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
