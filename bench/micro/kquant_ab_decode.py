"""Decode ms/token of a GGUF file on the OpenCL engine's paged step, this checkout against an earlier one.

For a kernel change (docs/decode-kernels.md): each round runs one subprocess per checkout in turn
(baseline, then this), each building an OpenCLEngine from its own code on the same file and timing
greedy paged steps at batch 1 and 8 (random KV at --context tokens, imported), so both see the same
load on a shared machine. Medians over every round's steps of the wall time and of the process's CPU
time per step (both PoCL threads' work: the steadier figure when other processes share the cores).

    python -m bench.micro.kquant_ab_decode --baseline DIR [--gguf FILE] [--rounds N] [--steps N] [--name NAME]

DIR: a checkout of the earlier commit (`git worktree add DIR COMMIT`) that has this module; FILE: default the
packaged model.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench._common import ROOT, checkout_env, progress, table, write_json

BATCHES = (1, 8)


def measure(tree: Path, gguf: str | None, steps: int, context: int) -> dict:
    """In this process, checkout `tree`'s engine: {batch: [(wall s, CPU s) per step]}."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench.micro.paged_step import time_paged  # the checkout's own timing loop (bench._common.checkout_env)

    from services.decode_fpga.config import EngineConfig
    from services.decode_fpga.device import select_device
    from services.decode_fpga.engine import OpenCLEngine
    from services.model.gguf_blocks import read_block_tensors
    from services.model.loading import load_model

    assert Path(sys.modules["services"].__file__).resolve().is_relative_to(tree.resolve())
    model = load_model(gguf) if gguf else load_model()
    eng = OpenCLEngine.create(model.config, model.weights, select_device(),
                              EngineConfig(weights_dtype="gguf", max_context=context + steps + 8, kv_cache_mb=256),
                              read_block_tensors(model.checkpoint, model.config))
    return {"bytes": eng.weights_nbytes,
            "steps": {b: time_paged(eng, eng.cfg, b, context, steps) for b in BATCHES}}


def commit_of(tree: Path) -> str:
    """The checkout's commit (its path is the machine's, not the result's)."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=False, help="a checkout of the earlier commit")
    ap.add_argument("--gguf", default=None, help="a GGUF file (default: the packaged model)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per batch, checkout and round")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--name", default="kquant_ab_decode")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.gguf, args.steps, args.context)))
        return 0
    trees = {"this": ROOT}
    if args.baseline:
        trees = {"baseline": args.baseline.resolve(), **trees}
    load_before = os.getloadavg()
    cells: dict[tuple[str, int], list] = {}
    nbytes = {}
    for r in range(args.rounds):
        for name, tree in trees.items():
            progress(f"round {r + 1}/{args.rounds}: {name}")
            cmd = [sys.executable, "-m", "bench.micro.kquant_ab_decode", "--child", str(tree),
                   "--steps", str(args.steps), "--context", str(args.context)] + (["--gguf", args.gguf] if args.gguf else [])
            done = subprocess.run(cmd, env=checkout_env(tree), cwd=ROOT, capture_output=True,
                                  text=True)
            if done.returncode:
                raise SystemExit(f"{name} ({tree}) failed:\n{done.stderr[-3000:]}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            nbytes[name] = got["bytes"]
            for b, xs in got["steps"].items():
                cells.setdefault((name, int(b)), []).extend(xs)
    lines, rows = [], []
    for (name, b), xs in cells.items():
        wall = statistics.median(w for w, _ in xs) * 1e3
        cpu = statistics.median(c for _, c in xs) * 1e3
        lines.append({"tree": name, "batch": b, "ms_per_step_median": wall, "ms_per_step_min": min(w for w, _ in xs) * 1e3,
                      "cpu_ms_per_step_median": cpu, "n": len(xs), "weight_bytes": nbytes[name]})
        rows.append([name, b, f"{nbytes[name] / 1e6:.1f}", f"{wall:.2f}", f"{min(w for w, _ in xs) * 1e3:.2f}",
                     f"{wall / b:.2f}", f"{cpu:.2f}"])
    print(table(["tree", "batch", "MB/step", "ms/step (median)", "ms/step (min)", "ms/token", "CPU ms/step"], rows))
    print(f"load average before {load_before}, after {os.getloadavg()}; {args.rounds} rounds x {args.steps} steps")
    write_json(args.name, {"trees": {k: commit_of(v) for k, v in trees.items()}, "gguf": args.gguf or "packaged",
                           "rounds": args.rounds, "steps": args.steps, "context": args.context,
                           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "lines": lines})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
