"""Prefix caching: TTFT of a chat load whose requests share a system prompt, the engines' cache on vs off.

Two stacks run side by side on free ports, one with both engines' prefix caching on and one with it
off (HYBRIDSERVE_PREFILL_ENABLE_PREFIX_CACHING / HYBRIDSERVE_DECODE_ENABLE_PREFIX_CACHING), and get
the same requests in turn (the order rotates round by round), so drift falls on both alike. Per
round and mode (`gpu`, `fpga`, `hybrid` through the `mode` body field; `--modes` adds `auto`), a fresh
300-token system prompt is cut from the repository's prose and followed by different user turns
(16-64 tokens): one request fills the cache (not measured), then `--requests` closed-loop requests
(`--clients` at once, default 1 so TTFT is not queueing) with short outputs (TTFT is the point).
Figures: TTFT and end-to-end p50/p99 per mode and setting (medians over rounds), the TTFT ratio
off / on (median of the per-round ratios; the issue's target is 3x), and each engine's prefix-cache
hit ratio over the measured requests when the engines export one (a `*prefix_cache*hit_rate*`
gauge, or `*prefix_cache*hits*` and `*prefix_cache*queries*` counters; absence is tolerated).
Prints a table, writes `prefix_cache.json` and `prefix_cache.png`.

    python -m bench.prefix_cache [--quick] [--modes gpu,fpga,hybrid] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench._common import RESULTS, progress, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.serving.client import Target, closed_loop, served_model, warm_up  # noqa: E402
from bench.serving.probe import scrape  # noqa: E402
from bench.serving.report import command_line, ms  # noqa: E402
from bench.serving.servers import Servers  # noqa: E402
from bench.serving.stats import over_rounds, summarize  # noqa: E402
from bench.serving.workload import CORPUS_FILES, chat_workload, corpus_ids  # noqa: E402

MODES = ("gpu", "fpga", "hybrid")
SETTINGS = ("on", "off")
ENGINES = ("prefill_gpu", "decode_fpga")


@dataclass(frozen=True)
class Preset:
    requests: int  # measured requests per (mode, setting, round)
    rounds: int
    system_tokens: int
    user_range: tuple[int, int]
    output_tokens: int


PRESETS = {"default": Preset(8, 3, 300, (16, 64), 16), "quick": Preset(3, 1, 300, (16, 64), 4)}


def caching_env(on: bool) -> dict[str, str]:
    from services.decode_fpga.settings import DecodeSettings
    from services.prefill_gpu.settings import PrefillSettings

    value = "true" if on else "false"
    return {PrefillSettings.env_name("enable_prefix_caching"): value,
            DecodeSettings.env_name("enable_prefix_caching"): value}


def hit_ratio(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The engine's prefix-cache hit ratio over what ran between two scrapes: its own hit-rate gauge
    when it has one, else hits / queries from the counters' increase; None when it exports neither."""
    for name, value in after.items():
        if "prefix_cache" in name and ("hit_rate" in name or "hit_ratio" in name):
            return value
    delta = lambda word: sum(v - before.get(n, 0.0) for n, v in after.items()  # noqa: E731
                             if "prefix_cache" in n and word in n and n.endswith("_total"))
    queries = delta("quer")
    return delta("hits") / queries if queries > 0 else None


def measure(target: Target, metrics: dict[str, str], system: list[int], users: list[list[int]], p: Preset,
            clients: int) -> dict:
    """Fill the cache with one request, then the measured ones; their summary and each engine's hit ratio."""
    asyncio.run(closed_loop(target, [(system + users[0], 1)], 1))
    before = {e: scrape(url, ("prefix_cache",)) for e, url in metrics.items()}
    reqs = [(system + u, p.output_tokens) for u in users[1:]]
    summary = summarize(*asyncio.run(closed_loop(target, reqs, clients)))
    summary["hit_ratio"] = {e: hit_ratio(before[e], scrape(url, ("prefix_cache",))) for e, url in metrics.items()}
    return summary


def ttft_speedups(runs: dict) -> dict:
    """Per mode: TTFT p50 off / on, the median of per-round ratios (each round's pair ran back to back)."""
    out = {}
    for mode, per in runs.items():
        pairs = [off["ttft_p50"] / on["ttft_p50"] for on, off in zip(per["on"], per["off"])
                 if on["ttft_p50"] and off["ttft_p50"]]
        out[mode] = statistics.median(pairs) if pairs else None
    return out


def plot(path: Path, results: dict, speedups: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = list(results)
    x = np.arange(len(modes))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, setting in enumerate(SETTINGS):
        p50 = [(results[m][setting]["median"]["ttft_p50"] or np.nan) * 1e3 for m in modes]
        p99 = [(results[m][setting]["median"]["ttft_p99"] or np.nan) * 1e3 for m in modes]
        bars = ax.bar(x + (i - 0.5) * 0.38, p50, 0.38, label=f"prefix cache {setting} (p50; tick: p99)")
        ax.scatter(x + (i - 0.5) * 0.38, p99, marker="_", s=300, color=bars.patches[0].get_facecolor())
    for xi, m in zip(x, modes):
        if speedups.get(m):
            ax.annotate(f"{speedups[m]:.1f}x", (xi, 0), xytext=(0, -28), textcoords="offset points", ha="center")
    ax.set_xticks(x, modes)
    ax.set_ylabel("TTFT ms (median over rounds)")
    ax.set_title("Shared system prompt: TTFT with the prefix cache on and off")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 3 requests per mode and setting")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--requests", type=int)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--rounds", "--repeats", type=int, dest="rounds")
    ap.add_argument("--seed", type=int, default=300)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    preset = "quick" if args.quick else "default"
    p = PRESETS[preset]
    requests, rounds, modes = args.requests or p.requests, args.rounds or p.rounds, args.modes.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus, corpus_sha = corpus_ids()
    servers = Servers()
    runs = {m: {s: [] for s in SETTINGS} for m in modes}
    try:
        urls = {s: servers.start_stack(out / f"prefix_cache_{s}_stack.log", caching_env(s == "on"), s) for s in SETTINGS}
        for s, url in urls.items():
            for m in modes:
                warm_up(Target(f"{m}/{s}", url, {"mode": m}, served_model(url)), corpus[:32], progress=progress)
        for r in range(rounds):
            for i, m in enumerate(modes):
                # a system prompt of its own per round and mode: the cache starts cold for each pair
                system, users = chat_workload(corpus, requests + 1, args.seed + 100 * r + i, p.system_tokens,
                                              p.user_range)
                order = SETTINGS if (r + i) % 2 == 0 else SETTINGS[::-1]
                for s in order:
                    progress(f"round {r + 1}/{rounds}: {m}, prefix cache {s} ({requests} requests)")
                    target = Target(f"{m}/{s}", urls[s], {"mode": m}, served_model(urls[s]))
                    metrics = {e: servers.metrics[f"{s}/{e}"] for e in ENGINES}
                    runs[m][s].append(measure(target, metrics, system, users, p, args.clients))
    finally:
        servers.stop()

    results = {m: {s: over_rounds(rs) for s, rs in per.items()} for m, per in runs.items()}
    speedups = ttft_speedups(runs)
    rows = []
    for m, per in results.items():
        for s, v in per.items():
            med, hits = v["median"], [rd["hit_ratio"] for rd in v["rounds"]]
            ratio = {e: statistics.median(xs) if (xs := [h[e] for h in hits if h[e] is not None]) else None
                     for e in ENGINES}
            v["hit_ratio_median"] = ratio
            rows.append([m, s, ms(med["ttft_p50"]), ms(med["ttft_p99"]), ms(med["e2e_p50"]),
                         " / ".join("-" if ratio[e] is None else f"{ratio[e]:.2f}" for e in ENGINES),
                         f"{speedups[m]:.2f}" if s == "off" and speedups[m] else "", v["totals"]["errors"]])
    print(table(["mode", "prefix cache", "TTFT p50 ms", "p99", "E2E p50 ms", "hit ratio prefill / decode",
                 "TTFT off/on", "errors"], rows))
    print(f"{p.system_tokens}-token shared system prompt, user turns {p.user_range[0]}-{p.user_range[1]} tokens, "
          f"{p.output_tokens} output tokens, {args.clients} client(s); medians over {rounds} interleaved rounds")
    png = plot(out / "prefix_cache.png", results, speedups)
    print(f"wrote {png}")
    write_json("prefix_cache", {
        "command": command_line(), "preset": preset, "rounds": rounds, "requests_per_run": requests, "clients": args.clients, "seed": args.seed,
        "system_tokens": p.system_tokens, "user_tokens": list(p.user_range), "output_tokens": p.output_tokens,
        "corpus": {"files": list(CORPUS_FILES), "tokens": len(corpus), "sha256_16": corpus_sha},
        "env": {s: caching_env(s == "on") for s in SETTINGS}, "processes": servers.pids,
        "results": results, "ttft_speedup_off_over_on": speedups, "plot": png.name}, out_dir=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
