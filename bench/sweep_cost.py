"""How long each engine's start-up profile sweep takes, and what it measured.

    python bench/sweep_cost.py gpu|fpga [--repeat N]

Loads the default model, builds the one engine, runs the sweep N times and prints the wall time of each
run and its samples (JSON): the figure to compare before and after a change to the sweep.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_engine(device: str):
    from services.model.loading import load_model

    if device == "gpu":
        from services.prefill_gpu.engine import TorchEngine
        from services.prefill_gpu.settings import PrefillSettings

        s = PrefillSettings()
        loaded = load_model(s.model)
        return TorchEngine(loaded.config, loaded.weights, device=s.device, dtype=s.dtype)
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.settings import DecodeSettings

    s = DecodeSettings()
    loaded = load_model(s.model)
    return OpenCLEngine.from_settings(loaded, s)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("device", choices=("gpu", "fpga"))
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    from services.engine import profile_sweep
    from services.engine.profile_sweep import run_sweep

    probe_agrees = getattr(profile_sweep, "probe_agrees", None)

    engine = build_engine(args.device)
    for i in range(args.repeat):
        t = time.perf_counter()
        samples = run_sweep(engine, args.device)
        wall = time.perf_counter() - t
        extra = {k: getattr(samples, k) for k in ("spread", "foreign_load") if hasattr(samples, k)}
        print(json.dumps({"run": i, "device": args.device, "wall_s": round(wall, 3), **extra,
                          "samples": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}
                                      for s in samples]}))
    if probe_agrees is not None:
        t = time.perf_counter()
        agrees = probe_agrees(engine, args.device, samples)
        print(json.dumps({"probe_s": round(time.perf_counter() - t, 3), "agrees": agrees}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
