"""The torch engine on a CUDA GPU: greedy parity with transformers, and step timings with and without graphs.

Measures, on the GPU it finds (the device is named in the JSON):
* parity: prompts of several lengths served together through the real scheduler and
  engine.step (CUDA graphs on), greedy tokens against transformers' generate on the same GPU,
  one prompt at a time, fp32;
* decode step ms at batch 1, 8, 64 (128-token contexts), eager and captured, and tokens/s;
* prefill of 128, 512 and 2048 tokens as one chunk, eager and captured;
* a scheduler-driven run of 64 prompts x 128 new tokens (tokens/s including the Python loop);
* transformers on the same GPU: prefill 512 and decode ms/token at batch 1 and 64 (its own cache).

The default GGUF is used when installed; otherwise (a lent GPU machine cannot receive the
98 MB file) a SmolLM2-shaped checkpoint with random weights, written as safetensors with
bench/cuda_check.py, which exercises every kernel path at the real sizes.

    python bench/gpu_engine.py [--out bench/results] [--name engine_gpu]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from services.engine.batching_settings import BatchingSettings  # noqa: E402
from services.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, Sequence  # noqa: E402
from services.model.loading import load_model  # noqa: E402
from services.prefill_gpu.engine import TorchEngine  # noqa: E402

BATCHING = BatchingSettings(kv_cache_mb=4096, max_num_batched_tokens=2048, max_num_seqs=64)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median wall ms of fn() with the GPU synchronised around each call."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def serve(engine, prompts, n_new, budget) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt through the scheduler and engine.step, and the wall seconds."""
    sched = Scheduler(SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size,
                                      max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=budget,
                                      enable_prefix_caching=False))
    seqs = [Sequence(i, p, n_new) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    t = time.perf_counter()
    while sched.has_unfinished():
        batch = sched.schedule()
        sampling = [c.seq_id for c in batch.chunks if c.samples]
        tokens = engine.step(batch.chunks, greedy=True) if not batch.is_empty else []
        sched.update(batch, dict(zip(sampling, tokens)))
    sync()
    return [s.output_token_ids for s in seqs], time.perf_counter() - t


def load(tmp: Path):
    try:
        loaded = load_model(os.environ.get("HYBRIDSERVE_MODEL") or None)
        path = loaded.checkpoint.path
        if loaded.checkpoint.kind != "gguf":
            return loaded, dict(pretrained=str(path)), str(path)
        return loaded, dict(pretrained=str(path.parent), gguf_file=path.name), path.name
    except Exception as exc:  # the model package is not installed on the GPU machine
        from cuda_check import smollm2_shaped_checkpoint

        print(f"default model unavailable ({type(exc).__name__}); a SmolLM2-shaped random checkpoint")
        path = smollm2_shaped_checkpoint(tmp)
        return load_model(str(path)), dict(pretrained=str(path)), "SmolLM2-shaped, random weights"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="engine_gpu")
    ap.add_argument("--smoke", action="store_true", help="on the CPU, tiny sizes: checks the script runs")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: nothing to measure")
        return 0
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = dict(prompts=(7, 60), new=4, batches=(1, 8), prefills=(128,), many=8, many_new=4, reps=2) if args.smoke \
        else dict(prompts=(7, 60, 200, 512), new=32, batches=(1, 8, 64), prefills=(128, 512, 2048), many=64,
                  many_new=128, reps=50)
    from transformers import AutoModelForCausalLM

    loaded, ref_args, model_name = load(Path(tempfile.mkdtemp()))
    cfg = loaded.config
    report = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__, "model": model_name,
              "dtype": "fp32", "timings_ms": {}, "parity": {}}
    rng = np.random.default_rng(0)
    engine = TorchEngine(cfg, loaded.weights, device=dev, batching=BATCHING)
    graphs = engine.graphs

    # ---- parity: scheduler + graphs against transformers, prompt by prompt --------------------
    ref = AutoModelForCausalLM.from_pretrained(ref_args.pop("pretrained"), dtype=torch.float32, **ref_args).to(dev).eval()
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in sizes["prompts"]]
    n_new = sizes["new"]
    ours, _ = serve(engine, prompts, n_new, budget=256)
    same = 0
    for p, o in zip(prompts, ours):
        with torch.no_grad():
            g = ref.generate(torch.tensor([p], device=dev), max_new_tokens=n_new, do_sample=False,
                             min_new_tokens=n_new, pad_token_id=0)
        theirs = g[0, len(p):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(o, theirs)) if a != b), None)
        report["parity"][f"prompt {len(p)}"] = {"identical": o == theirs, "first_difference": first}
        same += o == theirs
    print(f"parity: {same}/{len(prompts)} prompts' {n_new} greedy tokens identical to transformers "
          f"(graph replays {graphs.replays if graphs else None})")

    # ---- decode steps, eager and captured ---------------------------------------------------------
    bs = engine.block_size
    ctx = 128

    def decode_chunks(batch):
        out = []
        for i in range(batch):
            table = tuple(range(i * (ctx // bs + 1), (i + 1) * (ctx // bs + 1)))
            out.append(ScheduledChunk(i, ctx, (5,), table, True, None))
        return out

    for batch in sizes["batches"]:
        chunks = decode_chunks(batch)
        for way in ("eager", "graphs"):
            engine.graphs = graphs if way == "graphs" else None
            ms = cuda_ms(lambda: engine.step(chunks, greedy=True), sizes["reps"])
            report["timings_ms"][f"decode/b{batch}/{way}"] = ms
            print(f"decode batch {batch:2d} {way:6s}: {ms:7.3f} ms/step  {batch / ms * 1e3:9.0f} tok/s")
    # ---- prefill chunks -------------------------------------------------------------------------
    for n in sizes["prefills"]:
        ids = tuple(rng.integers(3, cfg.vocab_size, n).tolist())
        chunks = [ScheduledChunk(0, 0, ids, tuple(range(-(-n // bs))), True, None)]
        for way in ("eager", "graphs"):
            engine.graphs = graphs if way == "graphs" else None
            ms = cuda_ms(lambda: engine.step(chunks, greedy=True), max(2, sizes["reps"] // 5))
            report["timings_ms"][f"prefill/{n}/{way}"] = ms
            print(f"prefill {n:5d} {way:6s}: {ms:7.3f} ms  ({n / ms * 1e3:9.0f} tok/s)")
    engine.graphs = graphs
    # ---- the whole loop: 64 prompts x 128 new tokens ---------------------------------------------
    k, new = sizes["many"], sizes["many_new"]
    many = [rng.integers(3, cfg.vocab_size, 128).tolist() for _ in range(k)]
    serve(engine, many, 8, budget=2048)  # capture the buckets this run uses
    _, wall = serve(engine, many, new, budget=2048)
    report[f"scheduler_{k}x{new}_tok_s"] = k * new / wall
    print(f"scheduler loop, {k} prompts x {new} tokens: {k * new / wall:.0f} tok/s ({wall:.2f} s)")
    if graphs is not None:
        report["graphs"] = {"count": len(graphs.steps), "capture_s": graphs.capture_s, "replays": graphs.replays}

    # ---- transformers on the same GPU -----------------------------------------------------------
    for batch in (1, sizes["batches"][-1]):
        x = torch.tensor([rng.integers(3, cfg.vocab_size, ctx).tolist() for _ in range(batch)], device=dev)
        with torch.no_grad():
            out = ref(x, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)

            def one():
                nonlocal past, tok
                o = ref(tok, past_key_values=past, use_cache=True)
                past, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
            ms = cuda_ms(one, max(2, sizes["reps"] * 3 // 5))
        report["timings_ms"][f"transformers/decode/b{batch}"] = ms
        print(f"transformers decode batch {batch:2d}: {ms:7.3f} ms/step  {batch / ms * 1e3:9.0f} tok/s")
    x = torch.tensor([rng.integers(3, cfg.vocab_size, 512).tolist()], device=dev)
    with torch.no_grad():
        ms = cuda_ms(lambda: ref(x, use_cache=True), max(2, sizes["reps"] // 5))
    report["timings_ms"]["transformers/prefill/512"] = ms
    print(f"transformers prefill 512: {ms:7.3f} ms")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
