"""The torch engine on a CUDA GPU: greedy parity with transformers, and step timings with and without graphs.

Measures, on the GPU it finds (the device is named in the JSON), for three builds of the engine
in one process: the defaults (on CUDA: fused ops, [out, in] matrices), fused with [in, out]
matrices, and unfused with [in, out] matrices (the step before the fusing):
* parity: prompts of several lengths served together through the real scheduler and
  engine.step (CUDA graphs on), greedy tokens against transformers' generate on the same GPU,
  one prompt at a time, fp32, for each build; each build's largest logit difference from
  transformers at the last position of a 512-token prefill;
* decode step ms at batch 1, 8, 64 (128-token contexts), eager (defaults) and captured (each
  build), and tokens/s; a batch-1 graph replay alone (what the step costs past the host's work);
  the kernels of one eager batch-1 step from torch.profiler (how many, their summed GPU time, the
  costliest); each layer matrix's product in both layouts at 1, 4 and 64 rows;
* prefill of 128, 512 and 2048 tokens as one chunk, eager and captured (each build);
* a scheduler-driven run of 64 prompts x 128 new tokens (tokens/s including the Python loop);
* transformers on the same GPU: prefill 512 and decode ms/token at batch 1 and 64 (its own cache).

The default GGUF is used when installed; otherwise (a lent GPU machine cannot receive the
98 MB file) a SmolLM2-shaped checkpoint with random weights, written as safetensors, which
exercises every kernel path at the real sizes.

    python -m bench.micro.gpu_engine [--out bench/results] [--name engine_gpu]
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


def kernel_profile(fn) -> dict:
    """The GPU kernels one call of fn launches (eager, so each is its own launch): count, summed ms."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        rows = [r for r in prof.key_averages() if str(r.device_type).endswith("CUDA")]
        top = sorted(rows, key=lambda r: -r.device_time_total)[:12]
        return {"kernels": sum(r.count for r in rows), "gpu_ms": sum(r.device_time_total for r in rows) / 1e3,
                "top": [{"kernel": r.key[:90], "count": r.count, "us": round(r.device_time_total, 1)} for r in top]}
    except Exception as exc:  # a profiler that cannot trace here must not cost the run its other figures
        return {"error": f"{type(exc).__name__}: {exc}"}


def gemm_table(shapes: dict[str, tuple[int, int]], rows=(1, 4, 64), calls: int = 20) -> dict:
    """us per product of x [rows, in] with each layer matrix, stored [in, out] (x @ W) or [out, in]
    (F.linear), fp32, from a CUDA graph of `calls` products (so launch cost is a graph's, as in a step)."""
    out = {}
    for name, (k, n) in shapes.items():
        w_out_in = torch.randn(n, k, device="cuda")
        w_in_out = w_out_in.T.contiguous()
        for m in rows:
            x = torch.randn(m, k, device="cuda")
            for layout, fn in (("in_out", lambda: x @ w_in_out),
                               ("out_in", lambda: torch.nn.functional.linear(x, w_out_in))):
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(calls):
                        fn()
                us = cuda_ms(g.replay, 20) * 1e3 / calls
                out[f"{name} {k}x{n} m{m} {layout}"] = {"us": round(us, 2), "GB_s": round(k * n * 4 / us / 1e3, 1)}
    return out


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


def smollm2_shaped_checkpoint(directory: Path) -> Path:
    """SmolLM2-135M's shape with random weights (seeded), as a Hugging Face directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(directory, safe_serialization=True)
    return directory


def load(tmp: Path):
    try:
        loaded = load_model(os.environ.get("HYBRIDSERVE_MODEL") or None)
        path = loaded.checkpoint.path
        if loaded.checkpoint.kind != "gguf":
            return loaded, dict(pretrained=str(path)), str(path)
        return loaded, dict(pretrained=str(path.parent), gguf_file=path.name), path.name
    except Exception as exc:  # the model package is not installed on the GPU machine
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
    engine = TorchEngine(cfg, loaded.weights, device=dev, batching=BATCHING)  # the defaults ("auto")
    # the same step with the matrices [in, out] (fused), and as before fusing ([in, out], unfused)
    in_out = TorchEngine(cfg, loaded.weights, device=dev, batching=BATCHING, weight_layout="in_out")
    unfused = TorchEngine(cfg, loaded.weights, device=dev, batching=BATCHING, fused_ops="off",
                          weight_layout="in_out")
    report["defaults"] = {"fused_ops": engine.model.fused, "weight_layout": "out_in" if engine.model.out_in else "in_out"}
    graphs = engine.graphs

    # ---- parity: scheduler + graphs against transformers, prompt by prompt --------------------
    ref = AutoModelForCausalLM.from_pretrained(ref_args.pop("pretrained"), dtype=torch.float32, **ref_args).to(dev).eval()
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in sizes["prompts"]]
    n_new = sizes["new"]
    theirs_all = []
    for p in prompts:
        with torch.no_grad():
            g = ref.generate(torch.tensor([p], device=dev), max_new_tokens=n_new, do_sample=False,
                             min_new_tokens=n_new, pad_token_id=0)
        theirs_all.append(g[0, len(p):].tolist())
    for label, eng in (("parity", engine), ("parity_in_out", in_out), ("parity_unfused", unfused)):
        ours, _ = serve(eng, prompts, n_new, budget=256)
        report[label] = {}
        same = 0
        for p, o, theirs in zip(prompts, ours, theirs_all):
            first = next((i for i, (a, b) in enumerate(zip(o, theirs)) if a != b), None)
            report[label][f"prompt {len(p)}"] = {"identical": o == theirs, "first_difference": first}
            same += o == theirs
        print(f"{label} (fused={eng.model.fused}, out_in={eng.model.out_in}): {same}/{len(prompts)} prompts' {n_new} greedy tokens identical "
              f"to transformers (graph replays {eng.graphs.replays if eng.graphs else None})")
    long_prompt = prompts[-1]
    with torch.inference_mode():
        ref_logits = ref(torch.tensor([long_prompt], device=dev)).logits[0, -1].float()
        report["max_logit_diff"] = {"prompt_tokens": len(long_prompt)}
        for label, e in (("default", engine), ("in_out", in_out), ("unfused", unfused)):
            table = tuple(range(-(-len(long_prompt) // e.block_size)))  # the prompt as one chunk of a step
            step = e.step([ScheduledChunk(0, 0, tuple(long_prompt), table, True, None)], greedy=False)
            logits = torch.from_numpy(np.asarray(step[0])).to(dev)
            report["max_logit_diff"][f"{label}_vs_transformers"] = (logits - ref_logits).abs().max().item()
    print("largest logit differences, last position of a", len(long_prompt), "token prefill:",
          report["max_logit_diff"])

    # ---- decode steps, eager and captured ---------------------------------------------------------
    bs = engine.block_size
    ctx = 128

    def decode_chunks(batch):
        out = []
        for i in range(batch):
            table = tuple(range(i * (ctx // bs + 1), (i + 1) * (ctx // bs + 1)))
            out.append(ScheduledChunk(i, ctx, (5,), table, True, None))
        return out

    ways = {"eager": (engine, None), "graphs": (engine, graphs), "graphs_in_out": (in_out, in_out.graphs),
            "graphs_unfused": (unfused, unfused.graphs)}
    for batch in sizes["batches"]:
        chunks = decode_chunks(batch)
        for way, (eng, g) in ways.items():
            eng.graphs = g
            ms = cuda_ms(lambda: eng.step(chunks, greedy=True), sizes["reps"])
            report["timings_ms"][f"decode/b{batch}/{way}"] = ms
            print(f"decode batch {batch:2d} {way:14s}: {ms:7.3f} ms/step  {batch / ms * 1e3:9.0f} tok/s")
    engine.graphs = graphs
    if graphs is not None:  # the graph alone: what a step costs past the host's planning and argmax
        static = graphs.steps[graphs.bucket_for(decode_chunks(1))]
        report["timings_ms"]["decode/b1/replay_only"] = cuda_ms(static.graph.replay, sizes["reps"])
        print(f"decode batch  1 replay alone  : {report['timings_ms']['decode/b1/replay_only']:7.3f} ms")
    report["kernels_eager_b1"] = {label: kernel_profile(lambda: eng.step(decode_chunks(1), greedy=True))
                                  for label, eng in (("default", engine), ("unfused", unfused))}
    print("kernels of one eager batch-1 step:", json.dumps(report["kernels_eager_b1"], indent=1))
    if dev == "cuda":
        c = cfg
        report["gemm_us"] = gemm_table({
            "qkv": (c.hidden, c.q_dim + 2 * c.kv_dim), "o": (c.q_dim, c.hidden),
            "gate_up": (c.hidden, 2 * c.intermediate), "down": (c.intermediate, c.hidden),
            "lm_head": (c.hidden, c.vocab_size)})
        print("GEMM us per product (CUDA graph):", json.dumps(report["gemm_us"], indent=1))
    # ---- prefill chunks -------------------------------------------------------------------------
    for n in sizes["prefills"]:
        ids = tuple(rng.integers(3, cfg.vocab_size, n).tolist())
        chunks = [ScheduledChunk(0, 0, ids, tuple(range(-(-n // bs))), True, None)]
        for way, (eng, g) in ways.items():
            eng.graphs = g
            ms = cuda_ms(lambda: eng.step(chunks, greedy=True), max(2, sizes["reps"] // 5))
            report["timings_ms"][f"prefill/{n}/{way}"] = ms
            print(f"prefill {n:5d} {way:14s}: {ms:7.3f} ms  ({n / ms * 1e3:9.0f} tok/s)")
    engine.graphs = graphs
    del in_out, unfused
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
