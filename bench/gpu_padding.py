"""gpu mode's padding of every matmul to MIN_GEMM_ROWS rows: what a lone decode step pays, and the
alternatives that would keep a row's bits whatever the batch.

Two parts, both on the served model on this CPU:
* a lone decode step (one sequence, context 128) through the torch engine's batched step, padded
  (MIN_GEMM_ROWS = 4, MKL's default mode's floor) and unpadded (1: invariant only where the engine
  measured a floor of 1, as in MKL's strict mode on an Intel Xeon: `--mkl`), interleaved round by round;
  and the old slot path's decode of the same sequence (never padded) for scale;
* for each of the model's matrix shapes, whether a one-row product written another way gives the
  same bits as that row among 4+ rows (the contract the padding keeps): x @ W at M = 1, torch.mv,
  the transposed product (W^T @ x^T)^T at every M, and MKL's packed linear; and each one's time.

    python bench/gpu_padding.py [--rounds 5] [--reps 10] [--threads N] [--name gpu_padding] [--out DIR]

Prints two tables and writes gpu_padding.json under bench/results (or --out).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from _common import progress, stats, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from services.engine.batching_settings import BatchingSettings  # noqa: E402
from services.engine.scheduler import ScheduledChunk  # noqa: E402
from services.prefill_gpu.cpu_matmul import request_strict_mkl  # noqa: E402


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def one_row_ways(w: torch.Tensor) -> dict:
    """Ways of computing rows of x @ w ([K, N], as the model stores its matrices); name -> fn(x) -> [M, N]."""
    wT = w.t().contiguous()
    ways = {"x @ W (M rows as given)": lambda x: x @ w,
            "torch.mv per row": lambda x: torch.stack([torch.mv(wT, r) for r in x]),
            "(W^T @ x^T)^T": lambda x: torch.mm(wT, x.t()).t()}
    try:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(wT, 1)
        ways["MKL packed linear"] = lambda x: torch.ops.mkl._mkl_linear(x, packed, wT, None, x.shape[0])
    except (RuntimeError, AttributeError):
        pass
    return ways


def invariance(shapes, reps: int) -> list[dict]:
    """Per shape and way: does a row alone (M=1) give the bits it gets among 4, 8, 64 rows (M>=4 padded
    path's result), and the one-row time."""
    torch.manual_seed(0)
    out = []
    for k, n in shapes:
        w = torch.randn(k, n) * 0.08
        x = torch.randn(64, k) * 0.5
        among = (x @ w)[:8]  # what the padded step computes for these rows (the M >= 4 kernel)
        for name, fn in one_row_ways(w).items():
            alone = torch.cat([fn(x[i:i + 1]) for i in range(8)])
            self_consistent = all(torch.equal(fn(x[:m])[:1], alone[:1]) for m in (2, 3, 4, 8, 64))
            out.append({"shape": [k, n], "way": name, "alone_equals_padded": bool(torch.equal(alone, among)),
                        "same_bits_at_every_M": self_consistent, "one_row_ms": timed(lambda: fn(x[:1]), reps)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, as the engine runs)")
    ap.add_argument("--name", default="gpu_padding")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--mkl", choices=("strict", "default"), default="strict",
                    help="MKL's mode: strict, as prefill_gpu runs it (cpu_matmul.py), or its default")
    args = ap.parse_args()
    if args.mkl == "default":  # MKL starts in its default mode, and the engine's strict request comes too late
        torch.ones(4, 4) @ torch.ones(4, 4)
    mkl = request_strict_mkl()
    if args.threads:
        torch.set_num_threads(args.threads)

    from services.model.loading import load_model
    from services.prefill_gpu.engine import TorchEngine

    loaded = load_model()
    engine = TorchEngine(loaded.config, loaded.weights, device="cpu",
                         batching=BatchingSettings(kv_cache_mb=64, max_num_batched_tokens=256))
    engine.kv_pool.data.normal_(0, 0.5)
    context = 128
    n_blocks = -(-(context + 1) // engine.block_size)
    chunk = ScheduledChunk(1, context, (1234,), tuple(range(n_blocks)), True, None)
    seq = engine.new_sequence(context + 1)
    seq.k.normal_(0, 0.5), seq.v.normal_(0, 0.5)

    floor = engine.min_gemm_rows  # what the engine measured on this CPU (cpu_matmul.py)

    def step(rows: int):
        def run():
            engine.min_gemm_rows = rows
            try:
                engine.step([chunk], greedy=True)
            finally:
                engine.min_gemm_rows = floor
        return run

    def slot():
        seq.length = context
        engine.decode_greedy([seq], [1234])

    cases = {"step padded to 4 rows (today)": step(4), "step unpadded (1 row)": step(1),
             "slot path decode (1 row)": slot}
    results = {name: [] for name in cases}
    for r in range(args.rounds):
        progress(f"round {r + 1}/{args.rounds}")
        names = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in names:
            results[name].append(timed(cases[name], args.reps))
    summary = {name: stats(ms) for name, ms in results.items()}
    base = summary["step unpadded (1 row)"]["median"]
    print(table(["lone decode @ctx 128", "ms p50", "min", "x unpadded"],
                [[n, s["median"], s["min"], s["median"] / base] for n, s in summary.items()]))
    c = loaded.config
    shapes = sorted({tuple(t.shape) for t in (engine.model.layers[0].w_qkv, engine.model.layers[0].wo,
                                              engine.model.layers[0].w_gate_up, engine.model.layers[0].w_down,
                                              engine.model.lm_head_t)})
    inv = invariance(shapes, args.reps)
    print(table(["W [K, N]", "one row computed as", "= its bits among 4+ rows", "same bits at every M",
                 "one row ms"], [[f"{r['shape'][0]}x{r['shape'][1]}", r["way"], r["alone_equals_padded"],
                                  r["same_bits_at_every_M"], r["one_row_ms"]] for r in inv]))
    write_json(args.name, {"model": c.model_id, "mkl": mkl, "engine_row_floor": floor, "context": context, "rounds": args.rounds, "reps": args.reps,
                               "torch_threads": torch.get_num_threads(), "loadavg_1m_after": os.getloadavg()[0],
                               "lone_decode_ms": summary, "one_row_ways": inv}, args.out)


if __name__ == "__main__":
    main()
