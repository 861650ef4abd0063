"""Block GEMV per format on a 1B model's shapes (8192x2048, 2048x8192): time per launch, and the
process's CPU time per launch, which a busy machine disturbs far less than the wall clock. One row of
x by default; --rows N puts N rows through the batched GEMV the paged step uses (bind_gemv_rows).

Beside them, in the same process and rounds, the memory's yardstick: stream_read.cl reads ~40 MB
of fp32 rows in the GEMVs' launch shape (its GB/s by wall clock and by CPU time), and a numpy copy
(read + write, one thread). "of read" is a GEMV's GB/s over stream_read's, both by CPU time.

At one row the K-quants are bound by arithmetic on this CPU, not by memory, so the CPU time of a
launch (both PoCL threads together) is what a kernel change moves. Several distinct matrices are
launched in turn (one alone would sit in the caches); random blocks of each format (gguf-py cannot
quantize to K-quants; speed does not depend on the values). With --baseline, a checkout of an
earlier commit runs in alternate subprocesses, round by round, so both see the same load (each child runs its
checkout's code whole, this module included: bench._common.checkout_env; DIR must have it):

    python -m bench.micro.kquant_gemv [--rounds N] [--baseline DIR] [--formats q4_1,q4_k,q5_k,q6_k]
                                [--rows N] [--name RESULTS_NAME] [--plot] [--shapes 1024x2048] [--copies 1]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench._common import RESULTS, ROOT, checkout_env, progress, table, write_json

SHAPES = ((8192, 2048), (2048, 8192))
FORMATS = "q4_0,q4_1,q8_0,q5_0,q5_1,q4_k,q5_k,q6_k"
HERE = Path(__file__).resolve().parent


def cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def measure(tree: Path, formats: list[str], runs: int, n_rows: int = 1, shapes=SHAPES, copies: int = 0) -> list[dict]:
    """In this process, the code of checkout `tree`: per format and shape, `runs` timed passes. n_rows
    > 1: that many rows of x through bind_gemv_rows (the paged step's batched GEMV, each row with the
    one-row arithmetic), timed per launch as at one row."""
    import numpy as np
    import pyopencl as cl

    from services.decode_fpga.device import select_device
    from services.decode_fpga.quant_gemv import QuantMatrix
    from bench.micro.quant_gemv import synthetic  # gguf-py quantizes the legacy formats
    from tests.decode_fpga.kquant_checkpoint import random_blocks

    assert Path(sys.modules["services"].__file__).resolve().is_relative_to(tree.resolve())

    dev = select_device()
    x = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, n_rows * 8192 * 4)
    y = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, n_rows * 8192 * 4)
    sums = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, n_rows * 8192 // 32 * 4)
    count = cl.Buffer(dev.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                      hostbuf=np.array([n_rows], np.int32))
    cl.enqueue_fill_buffer(dev.queue, x, np.float32(0.01), 0, n_rows * 8192 * 4)
    cl.enqueue_fill_buffer(dev.queue, sums, np.float32(0.32), 0, n_rows * 8192 // 32 * 4)

    def bound(m):
        if n_rows == 1:
            return m.bind_gemv(x, y, 1, x_sums=sums).enqueue
        rows = m.bind_gemv_rows(x, y, count, x_sums=sums)
        return lambda q: rows.enqueue(q, 0, n_rows)
    out = stream_read(dev, runs)
    for rows, cols in shapes:
        n_mats = copies or max(3, int(40e6 // (rows * cols * 0.6)))  # ~40 MB of blocks: past the caches
        for fmt in formats:
            mats = [QuantMatrix(dev, synthetic(fmt, rows, cols, i) if fmt in ("q4_0", "q4_1", "q8_0")
                                else random_blocks(fmt, rows, cols, seed=i)) for i in range(n_mats)]
            launches = [bound(m) for m in mats]
            reps = max(2, int(4e6 // (rows * cols * 0.6 * n_rows)))
            for la in launches:
                la(dev.queue)
            dev.queue.finish()
            for _ in range(runs):
                t, c = time.perf_counter(), cpu_seconds()
                for _ in range(reps):
                    for la in launches:
                        la(dev.queue)
                dev.queue.finish()
                n = reps * n_mats
                out.append({"format": fmt, "rows": rows, "cols": cols, "bytes": mats[0].nbytes, "x_rows": n_rows,
                            "wall_us": (time.perf_counter() - t) / n * 1e6, "cpu_us": (cpu_seconds() - c) / n * 1e6})
            del launches, mats
    return out


def shapes(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(v) for v in s.split("x")) for s in text.split(","))


def stream_read(dev, runs: int, rows: int = 8192, row_bytes: int = 4608) -> list[dict]:
    """The yardstick lines (format "read"): stream_read.cl over ~40 MB, and a numpy copy (format
    "copy", one thread, read + write bytes), `runs` timed passes each."""
    import numpy as np
    import pyopencl as cl

    from bench._common import memory_bandwidth_gbs

    kernel = cl.Program(dev.context, (HERE / "stream_read.cl").read_text()).build().stream_read
    bufs = [cl.Buffer(dev.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                      hostbuf=np.ones(rows * row_bytes // 4, np.float32)) for _ in range(int(40e6 // (rows * row_bytes)) + 1)]
    y = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, rows * 4)
    launch = lambda b: kernel(dev.queue, (rows,), (1,), b, y, np.int32(row_bytes // 64))  # noqa: E731
    for b in bufs:
        launch(b)
    dev.queue.finish()
    out = []
    for _ in range(runs):
        t, c = time.perf_counter(), cpu_seconds()
        for _ in range(4):
            for b in bufs:
                launch(b)
        dev.queue.finish()
        n = 4 * len(bufs)
        out.append({"format": "read", "rows": rows, "cols": row_bytes // 4, "bytes": rows * row_bytes, "x_rows": 1,
                    "wall_us": (time.perf_counter() - t) / n * 1e6, "cpu_us": (cpu_seconds() - c) / n * 1e6})
        gbs = memory_bandwidth_gbs(256, 3)
        out.append({"format": "copy", "rows": 1, "cols": 1, "bytes": int(gbs * 1e6), "x_rows": 1,  # 1 ms's bytes
                    "wall_us": 1000.0, "cpu_us": 1000.0})
    return out


def plot(lines: list[dict], path: Path) -> Path:
    """GB/s by CPU time per format and shape, each tree beside the other, the read yardstick as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = list(dict.fromkeys(ln["tree"] for ln in lines))
    read = {t: next((ln["gbs_at_cpu_per_2_threads"] / ln["of_read"] for ln in lines if ln["tree"] == t
                     and ln["format"] == "read" and ln["of_read"]), None) for t in trees}
    gemv = [ln for ln in lines if ln["format"] not in ("read", "copy")]
    shapes = list(dict.fromkeys((ln["rows"], ln["cols"]) for ln in gemv))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), sharey=True, squeeze=False)
    for ax, (rows, cols) in zip(axes[0], shapes):
        fmts = list(dict.fromkeys(ln["format"] for ln in gemv))
        width = 0.8 / len(trees)
        for i, tree in enumerate(trees):
            vals = [next((ln["gbs_at_cpu_per_2_threads"] for ln in gemv if (ln["tree"], ln["format"], ln["rows"],
                          ln["cols"]) == (tree, f, rows, cols)), 0) for f in fmts]
            ax.bar([k + i * width for k in range(len(fmts))], vals, width, label=tree)
            if read[tree]:
                ax.axhline(read[tree], linestyle="--", linewidth=1, color=f"C{i}", label=f"stream read ({tree})")
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(fmts))], fmts)
        ax.set_title(f"{rows}x{cols}, batch 1")
        ax.set_ylabel("GB/s of device blocks (by CPU time, 2 threads)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path


def commit_of(tree: Path) -> str:
    """The checkout's commit (its path is the machine's, not the result's)."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="alternating subprocess rounds")
    ap.add_argument("--runs", type=int, default=3, help="timed passes per format and shape in a round")
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--plot", action="store_true", help="draw RESULTS_NAME.png beside the JSON")
    ap.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES), help="ROWSxCOLS,...")
    ap.add_argument("--copies", type=int, default=0, help="distinct matrices a shape (0: ~40 MB of them; "
                    "1: one, which the caches hold: the kernels' arithmetic alone)")
    ap.add_argument("--rows", type=int, default=1, help="rows of x a launch (>1: the batched GEMV)")
    ap.add_argument("--name", default="kquant_gemv", help="the results file's name")
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout of an earlier commit to compare")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)  # a checkout to measure
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    formats = args.formats.split(",")
    if args.child:
        print(json.dumps(measure(args.child, formats, args.runs, args.rows, shapes(args.shapes), args.copies)))
        return 0
    trees = {"this": ROOT}
    if args.baseline:
        trees = {"baseline": args.baseline.resolve(), **trees}
    load_before = os.getloadavg()
    samples: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        for name, tree in trees.items():
            progress(f"round {r + 1}/{args.rounds}: {name}")
            env = checkout_env(tree)
            done = subprocess.run([sys.executable, "-m", "bench.micro.kquant_gemv", "--child", str(tree),
                                   "--runs", str(args.runs), "--formats", args.formats, "--rows", str(args.rows),
                                   "--shapes", args.shapes, "--copies", str(args.copies)],
                                  env=env, cwd=ROOT, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{name} ({tree}) failed:\n{done.stderr[-3000:]}")
            for s in json.loads(done.stdout.strip().splitlines()[-1]):
                samples.setdefault((name, s["format"], s["rows"], s["cols"]), []).append(s)
    lines = []
    for (name, fmt, rows, cols), ss in samples.items():
        cpu = statistics.median(s["cpu_us"] for s in ss)
        wall = statistics.median(s["wall_us"] for s in ss)
        lines.append({"tree": name, "format": fmt, "rows": rows, "cols": cols, "bytes": ss[0]["bytes"],
                      "cpu_us_median": cpu, "wall_us_median": wall, "wall_us_min": min(s["wall_us"] for s in ss),
                      "gbs_at_cpu_per_2_threads": ss[0]["bytes"] / (cpu / 2 * 1e-6) / 1e9,
                      "gbs_at_wall_min": ss[0]["bytes"] / (min(s["wall_us"] for s in ss) * 1e-6) / 1e9, "n": len(ss)})
    # the yardstick pooled over the trees' rounds (the same machine; its spread is the load's, not the code's)
    read_cpu = [s["cpu_us"] for (_, f, _, _), ss in samples.items() if f == "read" for s in ss]
    read_bytes = next((ss[0]["bytes"] for (_, f, _, _), ss in samples.items() if f == "read"), 0)
    read = read_bytes / (statistics.median(read_cpu) / 2 * 1e-6) / 1e9 if read_cpu else None
    for ln in lines:
        ln["of_read"] = ln["gbs_at_cpu_per_2_threads"] / read if read else None
    print(table(["tree", "shape", "format", "bits/w", "CPU us (median)", "wall us (median)", "wall us (min)",
                 "GB/s at CPU/2", "GB/s at wall min", "of read"],
                [[ln["tree"], f"{ln['rows']}x{ln['cols']}", ln["format"], f"{ln['bytes'] * 8 / ln['rows'] / ln['cols']:.2f}",
                  f"{ln['cpu_us_median']:.0f}", f"{ln['wall_us_median']:.0f}", f"{ln['wall_us_min']:.0f}",
                  f"{ln['gbs_at_cpu_per_2_threads']:.1f}", f"{ln['gbs_at_wall_min']:.1f}",
                  f"{ln['of_read']:.2f}" if ln["of_read"] is not None else "-"] for ln in lines
                 if ln["format"] != "copy"]))
    for tree in trees:
        copy = [s["bytes"] / 1e6 for (t, f, _, _), ss in samples.items() if t == tree and f == "copy" for s in ss]
        if copy:
            print(f"{tree}: numpy copy (one thread, read + write) median {statistics.median(copy):.1f} GB/s")
    if read:
        print(f"stream read (both trees' rounds, by CPU time): {read:.1f} GB/s; 'of read' is each line over it")
    print(f"load average before {load_before}, after {os.getloadavg()}")
    write_json(args.name, {"trees": {k: commit_of(v) for k, v in trees.items()}, "rounds": args.rounds, "x_rows": args.rows,
                               "runs": args.runs, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                               "stream_read_gbs_at_cpu_per_2_threads": read, "lines": lines}, out_dir=Path(args.out))
    if args.plot:
        plot(lines, Path(args.out) / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
