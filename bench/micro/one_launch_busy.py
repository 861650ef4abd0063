"""One-sequence decode steps on a busy CPU: one launch, launch by launch, and the engine's choice.

decode_layers.cl runs every layer in one launch whose work-groups wait for each other at
barriers: fastest on idle cores, stalled when another process takes one. This times, at batch 1
and a 128-token context, paged steps (the serving path) of three engines on the same device:
  * one-launch   always one launch (the choice pinned; a step that gives up is redone by launches)
  * launches     launch by launch (an engine with layer_kernels off)
  * chosen       the engine as it serves: one_launch_choice.py picks per step
with 0, 1 and 2 busy processes beside them (one at a 30% duty cycle, as a gateway streaming
tokens might be; the others always busy), each cell's engines interleaved round by round.

    python -m bench.micro.one_launch_busy [--rounds 3] [--steps 60]

Prints ms per step (median, p90, max, mean) and writes bench/results/one_launch_busy.{json,png}.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from bench._common import RESULTS, CpuHog, progress, table, write_json
from bench.micro.paged_step import engines, time_paged_wall

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOADS = [("idle", 0, 1.0), ("1 process, 30% busy", 1, 0.3), ("1 busy process", 1, 1.0), ("2 busy processes", 2, 1.0)]
WAYS = ("one-launch", "launches", "chosen")


def main() -> None:
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.one_launch_choice import OneLaunchChoice

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per engine, load and round")
    args = ap.parse_args()
    cfg, one, launches = engines(1, 128 + args.steps + 8)
    chosen = OpenCLEngine(cfg, one.dev, one.config, one.weights)  # the same weights, a choice of its own
    one.one_launch_choice = pin = OneLaunchChoice(fixed=True)  # a step that gives up is still redone
    cells: dict[tuple[str, str], list[float]] = {}
    gave_up: dict[str, int] = {}
    for name, procs, duty in LOADS:
        with CpuHog(procs, duty):
            time.sleep(0.3)  # the processes are running
            for r in range(args.rounds):
                progress(f"{name}: round {r + 1}/{args.rounds}")
                for way, engine in zip(WAYS, (one, launches, chosen)):
                    cells.setdefault((name, way), []).extend(time_paged_wall(engine, cfg, 1, 128, args.steps))
        gave_up[name] = pin.gave_up
    rows, lines = [], []
    for name, *_ in LOADS:
        for way in WAYS:
            ms = np.array(cells[(name, way)]) * 1e3
            cell = {"load": name, "way": way, "median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
                    "max_ms": float(ms.max()), "mean_ms": float(ms.mean()), "steps": len(ms)}
            lines.append(cell)
            rows.append([name, way, cell["median_ms"], cell["p90_ms"], cell["max_ms"], cell["mean_ms"]])
    print(table(["load", "way", "median ms", "p90 ms", "max ms", "mean ms"], rows))
    print(f"the chosen engine: {chosen.one_launch_choice.state()}")
    write_json("one_launch_busy", {"rounds": args.rounds, "steps": args.steps, "device": one.device_name,
                                   "context": 128, "lines": lines, "pinned_gave_up_by_load": gave_up,
                                   "chosen_state": chosen.one_launch_choice.state()})
    plot(lines)


def plot(lines: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [name for name, *_ in LOADS]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.27
    for i, way in enumerate(WAYS):
        means = [next(c["mean_ms"] for c in lines if c["load"] == load and c["way"] == way) for load in loads]
        ax.bar(np.arange(len(loads)) + (i - 1) * width, means, width, label=way)
    ax.set_xticks(np.arange(len(loads)), loads)
    ax.set_ylabel("mean ms per decode step (batch 1)")
    ax.set_yscale("log")
    ax.set_title("one-sequence decode steps beside busy processes (2 cores, PoCL)")
    ax.legend()
    fig.tight_layout()
    path = RESULTS / "one_launch_busy.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
