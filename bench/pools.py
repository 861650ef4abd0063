"""One prefill engine feeding two decode engines (1P:2D) against two pairs (2P:2D), same machine, same load.

Each round starts one layout (`hybridserve up --prefill 1 --decode 2`, then `up --pairs 2`; the order
rotates round by round), warms it, runs closed-loop streaming clients at each concurrency level in
`hybrid` and `auto` mode with the same fresh-seeded requests (serving/workload.py: windows of the
repo's own prose, 64-256 prompt tokens, 32-96 output tokens, a unique first token per request), and
stops it. Medians over rounds: output tokens/s, TTFT and ITL p50. 1P:2D runs three engine processes
where 2P:2D runs four: on a machine whose cores both layouts share, that is the trade to see.

    python -m bench.pools [--rounds 2] [--concurrency 4,8]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path


from bench._common import RESULTS, progress, table, write_json  # noqa: E402
from bench.serving.client import Target, closed_loop, served_model, warm_up  # noqa: E402
from bench.serving.stats import summarize  # noqa: E402
from bench.serving.workload import Salter, corpus_ids, workload  # noqa: E402

from harness.stack import start_stack  # noqa: E402

LAYOUTS = {"1P:2D": ({"HYBRIDSERVE_UP_PREFILL_ENGINES": "1", "HYBRIDSERVE_UP_DECODE_ENGINES": "2"}, 1),
           "2P:2D": ({}, 2)}
MODES = ("hybrid", "auto")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="4,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    out = Path(args.out)
    levels = [int(c) for c in args.concurrency.split(",")]
    corpus, _ = corpus_ids()
    env = {"HYBRIDSERVE_PREFILL_KV_CACHE_MB": "256", "HYBRIDSERVE_DECODE_KV_CACHE_MB": "256"}
    runs: dict[str, dict[str, list[dict]]] = {}
    seed = 0
    for r in range(args.rounds):
        for name in (list(LAYOUTS) if r % 2 == 0 else list(LAYOUTS)[::-1]):
            extra, pairs = LAYOUTS[name]
            progress(f"round {r + 1}/{args.rounds}: {name}")
            stack = start_stack(out / f"pools_{name.replace(':', '')}.log", {**env, **extra}, pairs=pairs,
                                engines_per_kind=2)
            try:
                model = served_model(stack.url)
                for mode in MODES:
                    target = Target(f"{name} {mode}", stack.url, {"mode": mode}, model)
                    warm_up(target, corpus[:64], progress=progress)
                    for c in levels:
                        seed += 1
                        reqs = workload(corpus, max(args.requests, 2 * c), seed, (64, 256), (32, 96))
                        results, wall = asyncio.run(closed_loop(target, reqs, c, Salter(seed)))
                        runs.setdefault(f"{name} {mode}", {}).setdefault(str(c), []).append(summarize(results, wall))
            finally:
                stack.stop()
    rows, medians = [], {}
    for key, by_level in runs.items():
        for c, xs in by_level.items():
            med = {k: statistics.median(x[k] for x in xs if x[k] is not None)
                   for k in ("output_tok_s", "ttft_p50", "itl_p50")}
            med["errors"] = sum(x["errors"] for x in xs)
            medians.setdefault(key, {})[c] = med
            rows.append([key, c, f"{med['output_tok_s']:.1f}", f"{med['ttft_p50'] * 1e3:.0f}",
                         f"{med['itl_p50'] * 1e3:.1f}", med["errors"]])
    print(table(["layout mode", "clients", "tok/s", "TTFT p50 ms", "ITL p50 ms", "errors"], rows))
    write_json("pools", {"args": vars(args), "runs": runs, "medians": medians}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
