"""Every step of an engine while long prompts arrive beside running streams, in process: what the step
pacer (services/engine/step_pacer.py) gave each step and how long it took.

The service's own engine and scheduler settings (HYBRIDSERVE_DECODE_* for opencl, HYBRIDSERVE_PREFILL_*
for torch), under an EngineLoop: S streams decode, then P prompts of L tokens arrive one after another.
Each step the engine loop observes is recorded (decode rows, prompt tokens and the context they start
at, seconds, the pacer's cap and floor). Printed: the steps' p50 / p90 / p99 / max while the prompts
were prefilled (what the streams' ITL is made of, without the gRPC, gateway and SSE hops), the
prompts' TTFT, and every Nth step's detail. Rounds repeat the whole run; the JSON keeps every step.
Where serve.py's long-prompt variant measures a stack end to end, this shows why a step took long.

    python bench/long_prompt_steps.py [--engine opencl|torch] [--streams 4] [--prompts 2] [--tokens 2000]
                                      [--rounds 1] [--show 30]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, progress, table, write_json  # noqa: E402
from serving.stats import pct  # noqa: E402

import numpy as np  # noqa: E402

from services.engine.engine_loop import EngineLoop  # noqa: E402
from services.errors import Cancelled, ShuttingDown  # noqa: E402
from services.engine.runtime import scheduler_config  # noqa: E402
from services.engine.sampling import SamplingParams  # noqa: E402


def service_engine(kind: str):
    """(engine, scheduler config) as the service builds them, with its settings from the environment."""
    if kind == "opencl":
        from services.decode_fpga.engine import OpenCLEngine
        from services.decode_fpga.server import load
        from services.decode_fpga.settings import DecodeSettings

        settings = DecodeSettings()
        engine = OpenCLEngine.from_settings(load(settings), settings)
        return engine, scheduler_config(engine, settings, settings.max_context)
    from services.model.loading import load_model
    from services.prefill_gpu.cpu_matmul import request_strict_mkl
    from services.prefill_gpu.settings import PrefillSettings

    request_strict_mkl()  # as the service does, before any matmul
    from services.prefill_gpu.engine import TorchEngine

    settings, loaded = PrefillSettings(), load_model()
    engine = TorchEngine.from_settings(loaded, settings)
    return engine, scheduler_config(engine, settings, loaded.config.max_context)


def drain(events) -> None:
    """Read a stream's tokens until it ends: by its cancel at the end of the run."""
    try:
        for _ in events:
            pass
    except (Cancelled, ShuttingDown):
        pass


def run(engine, config, args, seed: int) -> dict:
    loop = EngineLoop(engine, config)
    pacer, steps = loop.scheduler.pacer, []
    observe = loop.scheduler.observe_step

    def recording(out, seconds):  # on the loop's thread, before the pacer learns from the step
        steps.append({"at": time.perf_counter(), "decodes": len(out.decodes), "seconds": seconds,
                      "prompt": [[c.num_tokens, c.start] for c in out.prefills],
                      "cap": pacer.last_cap, "floor": pacer.floor_now})
        observe(out, seconds)

    loop.scheduler.observe_step = recording
    rng = np.random.default_rng(seed)
    streams = [loop.submit(rng.integers(3, 40000, 64).tolist(),
                           SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True))
               for _ in range(args.streams)]
    readers = [threading.Thread(target=drain, args=(s.events(),), daemon=True) for s in streams]
    try:
        for r in readers:
            r.start()
        time.sleep(2.0)  # the streams decode alone first: the pacer measures their base
        first, ttft = len(steps), []
        for i in range(args.prompts):
            progress(f"prompt {i + 1}/{args.prompts} of {args.tokens} tokens")
            t0 = time.perf_counter()
            events = loop.submit(rng.integers(3, 40000, args.tokens).tolist(),
                                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)).events()
            next(events)
            ttft.append(time.perf_counter() - t0)
            for _ in events:
                pass
        during = steps[first:]
    finally:
        for s in streams:
            s.cancel()
        for r in readers:
            r.join(timeout=10)
        loop.close()
    ms = [s["seconds"] * 1e3 for s in during]
    return {"ttft_s": ttft, "steps": during, "step_ms": {"p50": pct(ms, 50), "p90": pct(ms, 90), "p99": pct(ms, 99),
                                                         "max": max(ms), "n": len(ms)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("opencl", "torch"), default="opencl")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--show", type=int, default=30, help="steps of the last round to print")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    progress(f"building the {args.engine} engine as its service does")
    engine, config = service_engine(args.engine)
    runs = []
    for r in range(args.rounds):
        progress(f"round {r + 1}/{args.rounds}")
        runs.append(run(engine, config, args, seed=r))
    last = runs[-1]["steps"]
    every = max(1, len(last) // max(1, args.show))
    if args.show:
        print(table(["decodes", "prompt tokens @ context", "ms", "cap", "floor"],
                    [[s["decodes"], ", ".join(f"{n} @ {c}" for n, c in s["prompt"]) or "-",
                      f'{s["seconds"] * 1e3:.1f}', s["cap"], s["floor"]] for s in last[::every]]))
    print(table(["round", "steps", "step p50 ms", "p90", "p99", "max", "prompts' TTFT s"],
                [[i + 1, x["step_ms"]["n"], f'{x["step_ms"]["p50"]:.0f}', f'{x["step_ms"]["p90"]:.0f}',
                  f'{x["step_ms"]["p99"]:.0f}', f'{x["step_ms"]["max"]:.0f}',
                  " / ".join(f"{t:.1f}" for t in x["ttft_s"])] for i, x in enumerate(runs)]))
    write_json(args.name or f"long_prompt_steps_{args.engine}",
               {"args": vars(args), "scheduler": repr(config), "runs": runs}, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
