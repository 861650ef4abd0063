"""Probe: the batch-1 decode step compiled by torch.compile (Inductor) and captured as a CUDA graph.

What the engine's own graphs (services/prefill_gpu/cuda_graphs.py) would gain from Inductor's
fused kernels, before building it in: the compile time, the step's replay ms against the
engine's captured step, and how far their logits are apart. Needs Triton and a C compiler on the
GPU machine; says so in the JSON when they are missing or the compile fails.

    python bench/gpu_compile.py [--out bench/results] [--name engine_gpu_compile]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import BATCHING, cuda_ms, load  # noqa: E402
from services.engine.scheduler import ScheduledChunk  # noqa: E402
from services.prefill_gpu.cuda_graphs import StaticStep  # noqa: E402
from services.prefill_gpu.engine import TorchEngine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="engine_gpu_compile")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cc": shutil.which("cc")}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError as exc:
        report["triton"] = f"missing: {exc}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded, _, report["model"] = load(Path(tempfile.mkdtemp()))
    engine = TorchEngine(loaded.config, loaded.weights, device="cuda", batching=BATCHING)
    bs = engine.block_size
    chunks = [ScheduledChunk(0, 128, (5,), tuple(range(128 // bs + 1)), True, None)]
    bucket = engine.graphs.bucket_for(chunks)
    engine.step(chunks, greedy=True)  # the engine's own graph for this bucket
    ours = engine.graphs.steps[bucket]
    report["engine_graph_replay_ms"] = cuda_ms(ours.graph.replay, 50)
    reference = ours.logits.clone()
    static = StaticStep(engine.model, engine.kv_pool, bucket)
    static.fill(chunks)
    try:
        compiled = torch.compile(static.forward, dynamic=False)
        t = time.perf_counter()
        with torch.inference_mode():
            for _ in range(2):
                compiled()
        torch.cuda.synchronize()
        report["compile_s"] = time.perf_counter() - t
        static.forward = compiled  # capture() records whatever forward is
        with torch.inference_mode():
            static.capture(engine.graphs.mempool)
        static.fill(chunks)
        torch.cuda.synchronize()
        report["compiled_graph_replay_ms"] = cuda_ms(static.graph.replay, 50)
        static.graph.replay()
        torch.cuda.synchronize()
        got = static.logits[:1]
        report["max_logit_diff_vs_engine"] = (got - reference[:1]).abs().max().item()
        report["same_argmax"] = bool(torch.equal(got.argmax(-1), reference[:1].argmax(-1)))
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    print(json.dumps(report, indent=1))
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
