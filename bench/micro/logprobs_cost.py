"""What logprobs and the sampling controls cost the engines: tokens/s of `c` concurrent greedy requests
through one engine loop, plain (the device's argmax) against logprobs (k = 5) and penalties, per engine;
on the OpenCL engine logprobs both ways, on the device and on the host.

A plain greedy step reads back one token id per sequence. A step with logprobs on the OpenCL engine
(its default) runs a log-softmax + top-k kernel over the rows (kernels/logprobs.cl) and reads back
2 + 2k words a row; with `logprobs host` (the engine's logprobs_on_device off, as the torch engine
always is) it reads back the rows' fp32 logits and runs the per-row log-softmax + top-k
(services/engine/logprobs.py) in the engine process. Penalties always take the host path
(logits_processing.py). The variants take turns within each round (order rotating) and every figure
is the median over rounds, so a busy shared machine's drift falls on all of them alike. In-process
engines on the default model (the OpenCL engine with the checkpoint's own blocks, as it serves); the
gateway's JSON for the logprobs is not in these figures.

Per row: the OpenCL engine's decode step of `c` rows timed alone, plain greedy, with logprobs on the
device and with the logits read back + logprobs on the host (interleaved, median), and the host's
own work per sampling row (`--host-only` alone): milliseconds per row for each kind of work.

    python -m bench.micro.logprobs_cost [--clients 8] [--tokens 32] [--rounds 3] [--engines torch,opencl]
    python -m bench.micro.logprobs_cost --host-only
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
from bench._common import machine, table, write_json

from services.engine.engine_loop import EngineLoop
from services.engine.sampling import SamplingParams
from services.engine.scheduler import SchedulerConfig

# name → (sampling controls, logprobs on the device where the engine can)
VARIANTS = {
    "greedy": ({}, True),
    "logprobs=5": ({"logprobs": 5}, True),
    "logprobs=5 host": ({"logprobs": 5}, False),
    "penalties": ({"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1}, True),
}


def make_engine(name: str, loaded, weights: str = "gguf"):
    if name == "torch":
        from services.prefill_gpu.engine import TorchEngine

        return TorchEngine(loaded.config, loaded.weights)  # CUDA where torch sees one, as the service
    from services.decode_fpga.config import EngineConfig
    from services.decode_fpga.device import select_device
    from services.decode_fpga.engine import OpenCLEngine
    from services.model.gguf_blocks import read_block_tensors

    blocks = read_block_tensors(loaded.checkpoint, loaded.config) if weights == "gguf" else None
    return OpenCLEngine.create(loaded.config, loaded.weights, select_device(),
                               EngineConfig(weights_dtype=weights, kv_cache_mb=128), blocks)


def step_cost(engine, rows: int, k: int, rounds: int, rng) -> dict[str, float]:
    """Milliseconds of one OpenCL decode step of `rows` one-token rows (median of `rounds`, the three ways
    interleaved): plain greedy; logprobs (k) on the device; the logits read back and logprobs on the host."""
    from services.engine.logprobs import LogprobsAsked, token_logprob
    from services.engine.scheduler import ScheduledChunk

    prompt = 32
    tables = [tuple(range(i * 4, i * 4 + 4)) for i in range(rows)]  # 4 blocks of 16 each: room for the prompt
    prompts = [rng.integers(3, engine.cfg.vocab_size, prompt).tolist() for _ in range(rows)]
    firsts = engine.step([ScheduledChunk(i, 0, tuple(p), t, True, None) for i, (p, t) in
                          enumerate(zip(prompts, tables))], greedy=True)
    decode = [ScheduledChunk(i, prompt, (int(f),), t, True, None) for i, (f, t) in enumerate(zip(firsts, tables))]
    asked = LogprobsAsked(k, [-1] * rows)

    def host():
        logits = engine.step(decode, greedy=False)
        return [token_logprob(row, int(np.argmax(row)), k) for row in logits]

    ways = {"greedy step": lambda: engine.step(decode, greedy=True),
            f"logprobs k={k} on the device": lambda: engine.step(decode, greedy=True, logprobs=asked),
            f"logprobs k={k} on the host (logits read back)": host}
    times: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(rounds):
        for w, fn in ways.items():
            start = time.perf_counter()
            fn()
            times[w].append((time.perf_counter() - start) * 1e3)
    return {w: statistics.median(xs) for w, xs in times.items()}


def run_level(loop: EngineLoop, prompts: list[list[int]], params: SamplingParams) -> float:
    """Output tokens/s of the prompts' requests run at once."""
    counts = [0] * len(prompts)

    def one(i: int) -> None:
        counts[i] = sum(1 for _ in loop.submit(prompts[i], params))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def host_cost(vocab: int, repeats: int = 5, calls: int = 200) -> dict[str, float]:
    """Milliseconds of host work per sampling row (the best of `repeats` timings of `calls` calls)."""
    from services.engine.logits_processing import process
    from services.engine.logprobs import token_logprob
    from services.engine.sampling import Sampler

    row = np.random.default_rng(0).normal(0, 3, vocab).astype(np.float32)
    context = np.random.default_rng(1).integers(0, vocab, 300).tolist()
    penalties = SamplingParams(**VARIANTS["penalties"][0])
    sampler = Sampler(SamplingParams(temperature=0.8, seed=1))
    work = {"argmax (the device's pick, on the host)": lambda: int(np.argmax(row)),
            "sample (temperature 0.8)": lambda: sampler.sample(row, position=10),
            "logprobs k=0": lambda: token_logprob(row, 5, 0),
            "logprobs k=5": lambda: token_logprob(row, 5, 5),
            "logprobs k=20": lambda: token_logprob(row, 5, 20),
            "penalties (300-token context)": lambda: process(row, penalties, context, 200, frozenset({2}))}
    out = {}
    for name, fn in work.items():
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - start) / calls * 1e3)
        out[name] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="torch,opencl")
    ap.add_argument("--host-only", action="store_true", help="only the per-row host cost")
    ap.add_argument("--weights", default="gguf", choices=["gguf", "fp32", "fp16"], help="the OpenCL engine's")
    ap.add_argument("--step-rounds", type=int, default=50, help="timed steps per way of the per-step cost")
    args = ap.parse_args()

    host = host_cost(49152)
    print(table(["host work per sampling row (vocab 49152)", "ms"], [[k, v] for k, v in host.items()]))
    if args.host_only:
        write_json("logprobs_cost_host", {"args": vars(args), "machine": machine(), "host_ms_per_row": host})
        return

    from services.model.loading import load_model

    loaded = load_model()
    rng = np.random.default_rng(0)
    results, steps = {}, None
    for name in args.engines.split(","):
        engine = make_engine(name, loaded, args.weights)
        if name == "opencl":
            steps = step_cost(engine, args.clients, 5, args.step_rounds, rng)
            base_ms = steps["greedy step"]
            print(table([f"OpenCL decode step of {args.clients} rows", "ms", "ms per row over greedy"],
                        [[w, v, (v - base_ms) / args.clients] for w, v in steps.items()]))
        config = SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size,
                                 max_num_seqs=max(args.clients, 1),
                                 max_num_batched_tokens=engine.max_num_batched_tokens,
                                 max_model_len=1024)
        loop = EngineLoop(engine, config, loaded.config.eos_token_ids)
        # the torch engine has one logprobs path (the rows read back): its host variant would repeat it
        order = [v for v in VARIANTS if VARIANTS[v][1] or hasattr(engine, "logprobs_on_device")]
        per_variant: dict[str, list[float]] = {v: [] for v in order}
        try:
            run_level(loop, [rng.integers(3, 49152, args.prompt).tolist()], SamplingParams(max_tokens=4, temperature=0))
            for r in range(args.rounds):
                for v in order[r % len(order):] + order[:r % len(order)]:
                    # fresh prompts each time: no prefix-cache hit makes one variant cheaper
                    prompts = [rng.integers(3, 49152, args.prompt).tolist() for _ in range(args.clients)]
                    controls, on_device = VARIANTS[v]
                    if hasattr(engine, "logprobs_on_device"):
                        engine.logprobs_on_device = on_device
                    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, **controls)
                    per_variant[v].append(run_level(loop, prompts, params))
        finally:
            loop.close()
        base = statistics.median(per_variant["greedy"])
        # each round's ratio to the greedy run next to it, then their median: a load that moves whole
        # rounds (other processes on a shared machine) falls out of it, unlike a ratio of medians
        results[name] = {v: {"tokens_per_s": statistics.median(xs), "rounds": xs,
                             "vs_greedy": statistics.median(xs) / base,
                             "vs_greedy_same_round": statistics.median(
                                 x / g for x, g in zip(xs, per_variant["greedy"]))}
                         for v, xs in per_variant.items()}
    rows = [[e, v, r["tokens_per_s"], f"{(r['vs_greedy'] - 1) * 100:+.1f}%",
             f"{(r['vs_greedy_same_round'] - 1) * 100:+.1f}%"] for e, vs in results.items() for v, r in vs.items()]
    print(table(["engine", "variant", "tokens/s", "vs greedy", "vs greedy, same round (median)"], rows))
    write_json("logprobs_cost", {"args": vars(args), "machine": machine(), "host_ms_per_row": host,
                                 "opencl_step_ms": steps, "results": results})


if __name__ == "__main__":
    main()
