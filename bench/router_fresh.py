"""Does `auto` pick the fastest mode on a fresh, busy machine? The router issue's measurement.

A new user's first start: an empty profile cache and a CPU hog running while the engines
calibrate. Then, through the OpenAI API with streaming:

1. cold: the first requests after the start, in `auto` only (nothing else has taught the router);
2. warm: the same fixed-seed requests in every forced mode and `auto`, interleaved request by
   request so the machine's noise falls on all modes alike;
3. load: closed-loop clients (1 and 8) sending a fixed-seed mix, each mode in turn.

Regret of a request = auto's end-to-end time / the fastest forced mode's for the same request.
It prints tables, writes bench/results/router_fresh.json and a plot.

    python -m bench.router_fresh [--requests 20] [--clients 1,8] [--rounds 2] [--no-hog] [--url URL]

Every run draws fresh prompt tokens (same lengths): a prompt run before would be a prefix-cache
hit, and whichever mode came later would look faster.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench._common import RESULTS, CpuHog, progress, table, write_json
from bench.serving.report import command_line
from bench.suite import FORCED, MODES, fresh_seed, one_request, percentile, warm_up

import httpx  # noqa: E402

PROMPT_RANGE = (30, 400)  # prompt tokens, as the load
OUTPUT_RANGE = (64, 192)  # output tokens


def workload(n: int, seed: int) -> list[tuple[int, int, int]]:
    """n requests as (prompt tokens, output tokens, prompt seed), fixed by `seed`."""
    rng = random.Random(seed)
    return [(rng.randint(*PROMPT_RANGE), rng.randint(*OUTPUT_RANGE), seed * 1000 + i) for i in range(n)]


def run_requests(url, model, headers, reqs, mode, salt: int) -> list[dict]:
    """`reqs` in `mode`, each prompt's tokens drawn from fresh_seed(seed, salt): the same lengths as
    every other run of these requests, never the same tokens (a prompt that ran before would be
    a prefix-cache hit, and a forced mode would look faster than auto did on a fresh prompt)."""
    return [one_request(url, model, headers, n_in, n_out, mode, fresh_seed(seed, salt)) for n_in, n_out, seed in reqs]


def regret(auto: list[dict], forced: dict[str, list[dict]]) -> dict:
    ratios = [a["e2e"] / min(forced[m][i]["e2e"] for m in FORCED) for i, a in enumerate(auto)]
    picked_best = [a["ran"] == min(FORCED, key=lambda m: forced[m][i]["e2e"]) for i, a in enumerate(auto)]
    total = sum(a["e2e"] for a in auto) / sum(min(forced[m][i]["e2e"] for m in FORCED) for i in range(len(auto)))
    return {"median": statistics.median(ratios), "max": max(ratios), "total_time_ratio": total,
            "picked_fastest_share": sum(picked_best) / len(picked_best), "per_request": ratios,
            "modes_picked": [a["ran"] for a in auto]}


def load(url, model, headers, clients: int, per_client: int, seed: int, rounds: int = 1) -> dict:
    """`clients` closed-loop streaming clients over a fixed mix, each mode in turn, for `rounds`
    rounds (the order rotated each round, so the machine's drift falls on every mode alike);
    tokens/s over all rounds."""
    acc = {m: {"tokens": 0, "wall": 0.0, "ttft": [], "itl": [], "picked": []} for m in MODES}
    for rnd in range(rounds):
        for mode in MODES[rnd % len(MODES):] + MODES[:rnd % len(MODES)]:
            reqs = workload(clients * per_client, seed)
            salt = 100 + 10 * clients + MODES.index(mode) + 1000 * rnd  # fresh prompts for every run
            a, lock = acc[mode], threading.Lock()

            def client(c: int) -> None:
                for n_in, n_out, s in reqs[c::clients]:
                    r = one_request(url, model, headers, n_in, n_out, mode, fresh_seed(s, salt))
                    with lock:
                        a["ttft"].append(r["ttft"])
                        a["itl"].extend(r["itl"])
                        a["tokens"] += r["tokens"]
                        a["picked"].append(r["ran"])

            progress(f"load: {mode}, {clients} clients x {per_client} (round {rnd + 1}/{rounds})")
            t0 = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(client, range(clients)))
            a["wall"] += time.perf_counter() - t0
    return {mode: {"tokens_per_s": a["tokens"] / a["wall"], "wall_s": a["wall"], "tokens": a["tokens"],
                   "ttft_p50": percentile(a["ttft"], 50), "ttft_p99": percentile(a["ttft"], 99),
                   "itl_p50": percentile(a["itl"], 50), "itl_p99": percentile(a["itl"], 99),
                   "modes_picked": {m: a["picked"].count(m) for m in FORCED if a["picked"].count(m)}}
            for mode, a in acc.items()}


def plot(path: Path, cold: dict, warm: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(1, len(cold["per_request"]) + 1), cold["per_request"], "o-", label="cold (first requests)")
    ax.plot(range(1, len(warm["per_request"]) + 1), warm["per_request"], "s-", label="warm")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("request")
    ax.set_ylabel("auto e2e / fastest forced e2e")
    ax.set_title("router regret after a fresh start on a busy machine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20, help="cold and warm requests (default 20)")
    ap.add_argument("--clients", default="1,8", help="load runs' client counts")
    ap.add_argument("--per-client", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="load runs per mode, interleaved (default 2)")
    ap.add_argument("--no-hog", action="store_true", help="start on an idle machine")
    ap.add_argument("--url", help="a running gateway (then nothing is started and the cache is not fresh)")
    ap.add_argument("--api-key")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    out = Path(args.out)
    stack = None
    url = args.url
    started = time.perf_counter()
    if not url:
        from bench._stack import start_stack

        cache = tempfile.mkdtemp(prefix="hybridserve-profile-")  # a fresh clone's empty cache
        hog = CpuHog(0 if args.no_hog else os.cpu_count() or 2)
        with hog:
            stack = start_stack(out / "router_fresh_stack.log", {"HYBRIDSERVE_PROFILE_CACHE": cache})
            url = stack.url
            model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
            warm_up(url, model, headers, "hybrid")  # the hog runs through the engines' calibration
    start_s = time.perf_counter() - started
    try:
        model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        reqs = workload(args.requests, seed=15)
        progress(f"cold: {len(reqs)} auto requests")
        cold_auto = run_requests(url, model, headers, reqs, "auto", salt=1)
        progress("warm: every mode, interleaved request by request")
        warm_runs = {m: [] for m in MODES}
        for i, req in enumerate(reqs):
            for m in MODES[i % len(MODES):] + MODES[: i % len(MODES)]:
                warm_runs[m].append(run_requests(url, model, headers, [req], m, salt=2 + MODES.index(m))[0])
        cold = regret(cold_auto, warm_runs)
        warm = regret(warm_runs["auto"], warm_runs)
        loads = {c: load(url, model, headers, int(c), args.per_client, seed=16, rounds=args.rounds)
                 for c in args.clients.split(",")}
        debug = httpx.get(url + "/debug/router", headers=headers, timeout=30)
    finally:
        if stack:
            stack.stop()
    print(table(["requests", "median regret", "max", "total time ratio", "picked fastest"],
                [[name, r["median"], r["max"], r["total_time_ratio"], f"{r['picked_fastest_share']:.0%}"]
                 for name, r in (("cold", cold), ("warm", warm))]))
    for c, res in loads.items():
        best = max(res[m]["tokens_per_s"] for m in FORCED)
        print(f"\n{c} client(s): auto / best forced tokens/s = {res['auto']['tokens_per_s'] / best:.3f}")
        print(table(["mode", "tokens/s", "ITL p50 ms", "TTFT p50 s", "TTFT p99 s"],
                    [[m, r["tokens_per_s"], 1e3 * (r["itl_p50"] or 0), r["ttft_p50"], r["ttft_p99"]]
                     for m, r in res.items()]))
    write_json("router_fresh", {"start_s": start_s, "hog": not args.no_hog and not args.url,
                                "cold": cold, "warm": warm, "load": loads,
                                "router": debug.json() if debug.status_code == 200 else None,
                                "command": command_line()}, out)
    plot(out / "router_fresh.png", cold, warm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
