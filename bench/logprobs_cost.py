"""What logprobs and the sampling controls cost the engines: tokens/s of `c` concurrent greedy requests
through one engine loop, plain (the device's argmax) against logprobs (k = 5) and penalties, per engine.

A plain greedy step reads back one token id per sequence; a step with logprobs or a control reads back
the rows' fp32 logits and runs the per-row log-softmax + top-k (services/engine/logprobs.py) or the
controls (logits_processing.py) in the engine process. The variants take turns within each round
(order rotating) and every figure is the median over rounds, so a busy shared machine's drift falls
on all of them alike. In-process engines on the default model; the gateway's JSON for the logprobs
is not in these figures.

The engine runs share the machine with whatever else runs; the per-row host cost (`--host-only`
alone) does not depend on that much: milliseconds per sampling row for each kind of work, the
figure to set beside a step's time.

    python bench/logprobs_cost.py [--clients 8] [--tokens 32] [--rounds 3] [--engines torch,opencl]
    python bench/logprobs_cost.py --host-only
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
from _common import machine, table, write_json

from services.engine.engine_loop import EngineLoop
from services.engine.sampling import SamplingParams
from services.engine.scheduler import SchedulerConfig

VARIANTS = {
    "greedy": {},
    "logprobs=5": {"logprobs": 5},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1},
}


def make_engine(name: str, loaded):
    if name == "torch":
        from services.prefill_gpu.engine import TorchEngine

        return TorchEngine(loaded.config, loaded.weights, device="cpu")
    from services.decode_fpga.config import EngineConfig
    from services.decode_fpga.device import select_device
    from services.decode_fpga.engine import OpenCLEngine

    return OpenCLEngine.create(loaded.config, loaded.weights, select_device(), EngineConfig(kv_cache_mb=128))


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
    penalties = SamplingParams(**VARIANTS["penalties"])
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
    args = ap.parse_args()

    host = host_cost(49152)
    print(table(["host work per sampling row (vocab 49152)", "ms"], [[k, v] for k, v in host.items()]))
    if args.host_only:
        write_json("logprobs_cost_host", {"args": vars(args), "machine": machine(), "host_ms_per_row": host})
        return

    from services.model.loading import load_model

    loaded = load_model()
    rng = np.random.default_rng(0)
    results = {}
    for name in args.engines.split(","):
        engine = make_engine(name, loaded)
        config = SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size,
                                 max_num_seqs=max(args.clients, 1),
                                 max_num_batched_tokens=engine.max_num_batched_tokens,
                                 max_model_len=1024)
        loop = EngineLoop(engine, config, loaded.config.eos_token_ids)
        per_variant: dict[str, list[float]] = {v: [] for v in VARIANTS}
        order = list(VARIANTS)
        try:
            run_level(loop, [rng.integers(3, 49152, args.prompt).tolist()], SamplingParams(max_tokens=4, temperature=0))
            for r in range(args.rounds):
                for v in order[r % len(order):] + order[:r % len(order)]:
                    # fresh prompts each time: no prefix-cache hit makes one variant cheaper
                    prompts = [rng.integers(3, 49152, args.prompt).tolist() for _ in range(args.clients)]
                    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, **VARIANTS[v])
                    per_variant[v].append(run_level(loop, prompts, params))
        finally:
            loop.close()
        base = statistics.median(per_variant["greedy"])
        results[name] = {v: {"tokens_per_s": statistics.median(xs), "rounds": xs,
                             "vs_greedy": statistics.median(xs) / base} for v, xs in per_variant.items()}
    rows = [[e, v, r["tokens_per_s"], f"{(r['vs_greedy'] - 1) * 100:+.1f}%"]
            for e, vs in results.items() for v, r in vs.items()]
    print(table(["engine", "variant", "tokens/s", "vs greedy"], rows))
    write_json("logprobs_cost", {"args": vars(args), "machine": machine(), "host_ms_per_row": host,
                                 "results": results})


if __name__ == "__main__":
    main()
