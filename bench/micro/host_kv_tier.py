"""Returning conversations with and without the host-memory KV tier, on the OpenCL engine, interleaved.

The device pool holds a quarter of the working set (the scheduler hands out that many of the
engine's blocks): C conversations, each a prompt of P tokens, come back in turn, each return its
earlier prompt plus a new user line. Without the tier a return finds what stayed on the device (by
then little: the others evicted it) and prefills the rest again; with it, the evicted blocks load
back from host memory. Per run: TTFT (submit to first token, engine loop included) of every return,
its median, and the prompt tokens found cached. The two configurations alternate round by round.

    python -m bench.micro.host_kv_tier [--conversations 8] [--prompt 256] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


from bench._common import RESULTS, progress, table, write_json  # noqa: E402

from services.engine.engine_loop import EngineLoop  # noqa: E402
from services.engine.sampling import SamplingParams  # noqa: E402
from services.engine.scheduler import SchedulerConfig  # noqa: E402


def run(engine, args, host_mb: int, seed: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    bs = engine.block_size
    working_set = args.conversations * -(-(args.prompt + args.turn + args.max_tokens * 2) // bs)
    config = SchedulerConfig(num_blocks=max(working_set // 4, 2 * -(-(args.prompt + args.turn + args.max_tokens) // bs)),
                             block_size=bs, max_num_seqs=1, max_num_batched_tokens=engine.max_num_batched_tokens,
                             max_model_len=2048,
                             host_kv_cache_mb=host_mb)
    loop = EngineLoop(engine, config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        prompts = [rng.integers(3, 40000, args.prompt).tolist() for _ in range(args.conversations)]

        def ttft(prompt) -> float:
            t0 = time.perf_counter()
            events = loop.submit(prompt, params).events()
            first = next(events)
            dt = time.perf_counter() - t0
            prompt.append(first.token)
            for ev in events:
                prompt.append(ev.token)
            return dt
        for p in prompts:  # first turns
            ttft(p)
        bm = loop.scheduler.block_manager
        hits0, queried0 = bm.num_hit_tokens, bm.num_queried_tokens
        times = []
        for p in prompts:  # every conversation returns with a new user line
            p.extend(rng.integers(3, 40000, args.turn).tolist())
            times.append(ttft(p))
        return {"ttft_p50": statistics.median(times), "ttft": times, "device_blocks": config.num_blocks,
                "working_set_blocks": working_set,
                "cached_share": (bm.num_hit_tokens - hits0) / max(1, bm.num_queried_tokens - queried0)}
    finally:
        loop.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--turn", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--host-mb", type=int, default=1024)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.settings import DecodeSettings
    from services.model.loading import load_model

    # the service's own engine (its settings: HYBRIDSERVE_DECODE_*); the scheduler here hands out a
    # quarter of the working set of its blocks
    engine = OpenCLEngine.from_settings(load_model(), DecodeSettings())
    results = {"with tier": [], "without": []}
    for r in range(args.rounds):
        order = ("with tier", "without") if r % 2 == 0 else ("without", "with tier")
        for name in order:
            progress(f"round {r + 1}/{args.rounds}: {name}")
            results[name].append(run(engine, args, args.host_mb if name == "with tier" else 0, seed=r))
    rows, med = [], {}
    for name, runs in results.items():
        med[name] = statistics.median(x["ttft_p50"] for x in runs)
        rows.append([name, f"{med[name] * 1e3:.0f}", f"{statistics.median(x['cached_share'] for x in runs):.2f}",
                     f"{runs[0]['device_blocks']} of {runs[0]['working_set_blocks']}"])
    print(table(["configuration", "returning TTFT p50 ms", "prompt share cached", "device blocks"], rows))
    ratio = med["with tier"] / med["without"]
    print(f"with / without the tier: {ratio:.2f}x TTFT p50 (median of {args.rounds} rounds)")
    write_json("host_kv_tier", {"args": vars(args), "runs": results,
                                "ttft_p50_ratio": ratio}, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
