"""Prefix-aware against least-loaded pair choice, side by side in one run, on two engine pairs.

One `hybridserve up --pairs 2` stack and two gateways in front of the same pairs: the stack's own
(prefix routing on, the default) and a second one started here with prefix routing off
(HYBRIDSERVE_GATEWAY_PREFIX_ROUTING=false). Each round runs every workload through each gateway
in turn (the order rotates round by round); each run draws fresh words, so no run's prompts share
a prefix with another run's and neither gateway profits from the other's cache.

* `multiturn`: C conversations of T turns at once, each conversation's turns in order; turn t's
  prompt is the conversation so far (every earlier user line and the model's reply) and a new
  user line. Greedy, `--max-tokens` per reply.
* `skewed`: C closed-loop clients, every prompt one hot system prompt and a user line of its own.
  While it runs each engine's requests (running + waiting) are sampled; the busiest engine's mean
  over the least busy one's is the balance figure.

Per gateway: the engines' prefix-cache hit rate over the run (hits / queried prompt tokens, all
four engines' counters), TTFT p50/p99, output tokens/s, and the gateway's placements by reason.
Medians over rounds. Writes `fleet_routing.json` and prints the table. Several KV budgets
(`--kv-cache-mb 130,160`) run one after another, a stack each, and are also plotted against the
budget (NAME.png): how much placement matters depends on how scarce KV memory is.

    python -m bench.fleet_routing [--rounds 2] [--conversations 8] [--turns 4] [--mode fpga]
    python -m bench.fleet_routing --kv-cache-mb 112 --conversations 8 --turns 6 --workloads multiturn \
        --name fleet_routing_pressure     # KV budgets below the conversations' working set
    python -m bench.fleet_routing --kv-cache-mb 130,160,190,240 --conversations 16 --turns 8 --think-s 3 \
        --workloads multiturn --name fleet_routing_budgets   # a stack per budget; also NAME.png
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

import httpx


from bench._common import RESULTS, ROOT, progress, table, write_json  # noqa: E402
from bench.serving.client import async_client  # noqa: E402
from bench.serving.probe import Periodic, scrape  # noqa: E402
from bench.serving.stats import pct  # noqa: E402
from bench.serving.workload import CORPUS_FILES  # noqa: E402

from harness.process import Process, free_port, http_ok  # noqa: E402
from harness.stack import start_stack  # noqa: E402

GATEWAYS = ("prefix-aware", "least-loaded")


def corpus_words() -> list[str]:
    text = "\n".join((ROOT / f).read_text() for f in CORPUS_FILES if (ROOT / f).is_file())
    return [w for w in re.split(r"\s+", text) if w.isalpha()]


def line(words: list[str], rng: random.Random, n: int) -> str:
    start = rng.randrange(len(words) - n)
    return " ".join(words[start:start + n])


async def complete(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed completion: TTFT, text, tokens (or the error)."""
    t0, first, text, tokens = time.perf_counter(), None, "", 0
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}"}
        async for raw in r.aiter_lines():
            if not raw.startswith("data: {"):
                continue
            chunk = json.loads(raw[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", []):
                if c.get("text"):
                    first = first or time.perf_counter() - t0
                    text += c["text"]
    return {"error": None, "ttft": first, "text": text, "tokens": tokens}


async def multiturn(url: str, model: str, args, rng: random.Random, words: list[str]) -> list[dict]:
    async with async_client(args.conversations) as client:
        async def conversation(i: int) -> list[dict]:
            history, out = "", []
            for _ in range(args.turns):
                history += f"\n\nUser: {line(words, rng, args.user_words)}\nAssistant:"
                r = await complete(client, url, {"model": model, "prompt": history.lstrip(), "max_tokens": args.max_tokens,
                                                 "temperature": 0, "ignore_eos": True, "mode": args.mode})
                out.append(r)
                history += r.get("text", "")
                if args.think_s:  # the user reads and types: other conversations' turns run meanwhile
                    await asyncio.sleep(rng.uniform(0, args.think_s))
            return out
        runs = await asyncio.gather(*(conversation(i) for i in range(args.conversations)))
    return [r for run in runs for r in run]


async def skewed(url: str, model: str, args, rng: random.Random, words: list[str]) -> list[dict]:
    system = "System: " + line(words, rng, args.system_words)
    queue = [f"{system}\n\nUser: {line(words, rng, args.user_words)}\nAssistant:"
             for _ in range(args.conversations * args.turns)]
    results: list[dict] = []
    async with async_client(args.conversations) as client:
        async def worker() -> None:
            while queue:
                results.append(await complete(client, url, {"model": model, "prompt": queue.pop(),
                                                            "max_tokens": args.max_tokens, "temperature": 0,
                                                            "ignore_eos": True, "mode": args.mode}))
        await asyncio.gather(*(worker() for _ in range(args.conversations)))
    return results


def counters(endpoints: list[str]) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens) summed over the engines."""
    hits = queries = 0.0
    for url in endpoints:
        s = scrape(url, ("prefix_cache",))
        hits += s.get("hybridserve_engine_prefix_cache_hits_total", 0.0)
        queries += s.get("hybridserve_engine_prefix_cache_queries_total", 0.0)
    return hits, queries


def placements(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    return {r: float(v) for r, v in re.findall(r'^hybridserve_pair_placements_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


class QueueSampler(Periodic):
    """Each engine's running + waiting requests, every 0.25 s, while the load is on."""

    interval_s = 0.25

    def __init__(self, endpoints: dict[str, str]):
        self.endpoints, self.samples = endpoints, {n: [] for n in endpoints}

    def sample(self) -> None:
        for name, url in self.endpoints.items():
            s = scrape(url, ("num_requests",))
            self.samples[name].append(s.get("hybridserve_engine_num_requests_running", 0.0)
                                      + s.get("hybridserve_engine_num_requests_waiting", 0.0))

    def balance(self) -> dict:
        means = {n: statistics.fmean(v) if v else 0.0 for n, v in self.samples.items()}
        lo, hi = min(means.values()), max(means.values())
        return {"mean_queue": means, "busiest_over_least": hi / lo if lo > 0 else None}


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def run_budget(args, kv_mb: int, workloads, words: list[str], out: Path) -> dict[str, dict[str, list[dict]]]:
    """One stack whose engines each hold kv_mb of KV, both gateways in front, every round and workload."""
    env = {"HYBRIDSERVE_PREFILL_KV_CACHE_MB": str(kv_mb), "HYBRIDSERVE_DECODE_KV_CACHE_MB": str(kv_mb)}
    stack = start_stack(out / "fleet_stack.log", env, pairs=2)
    other = None
    try:
        pairs = ";".join(f"127.0.0.1:{stack.pair_port('prefill', i)},127.0.0.1:{stack.pair_port('decode', i)}"
                         for i in range(2))
        port = free_port()
        other = Process("services.gateway", {"HYBRIDSERVE_GATEWAY_PAIRS": pairs, "HYBRIDSERVE_GATEWAY_PORT": str(port),
                                             "HYBRIDSERVE_GATEWAY_PREFIX_ROUTING": "false"},
                        out / "fleet_gateway_least_loaded.log").start()
        other.wait_until(http_ok(f"http://127.0.0.1:{port}/health"), 600, "up", interval=1.0)
        urls = {"prefix-aware": stack.url, "least-loaded": f"http://127.0.0.1:{port}"}
        model = httpx.get(stack.url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
        engines = {f"{e}{i}": f"http://127.0.0.1:{stack.pair_port(e + '_metrics', i)}/metrics"
                   for i in range(2) for e in ("prefill", "decode")}
        rounds: dict[str, dict[str, list[dict]]] = {w: {g: [] for g in GATEWAYS} for w, _ in workloads}
        seed = 0
        for r in range(args.rounds):
            order = GATEWAYS if r % 2 == 0 else GATEWAYS[::-1]
            for workload, run in workloads:
                for g in order:
                    seed += 1
                    progress(f"{kv_mb} MB, round {r + 1}/{args.rounds}: {workload} through the {g} gateway")
                    before, placed0 = counters(list(engines.values())), placements(urls[g])
                    t0 = time.perf_counter()
                    with QueueSampler({k: v for k, v in engines.items() if k.startswith("decode")}) as q:
                        results = asyncio.run(run(urls[g], model, args, random.Random(seed), words))
                    wall = time.perf_counter() - t0
                    after, placed1 = counters(list(engines.values())), placements(urls[g])
                    ok = [x for x in results if not x.get("error")]
                    queried = after[1] - before[1]
                    rounds[workload][g].append({
                        "hit_rate": (after[0] - before[0]) / queried if queried else None,
                        "ttft_p50": pct([x["ttft"] for x in ok], 50), "ttft_p99": pct([x["ttft"] for x in ok], 99),
                        "tok_s": sum(x["tokens"] for x in ok) / wall, "errors": len(results) - len(ok),
                        "placements": {k: placed1.get(k, 0) - placed0.get(k, 0) for k in placed1},
                        **q.balance()})
        return rounds
    finally:
        if other is not None:
            other.stop()
        stack.stop()


def medians(rounds: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    """Per workload and gateway: the medians over rounds, the total errors."""
    out: dict[str, dict[str, dict]] = {}
    for workload, by_gateway in rounds.items():
        for g, runs in by_gateway.items():
            med = {k: statistics.median([x[k] for x in runs if x[k] is not None] or [float("nan")])
                   for k in ("hit_rate", "ttft_p50", "ttft_p99", "tok_s")}
            bal = [x["busiest_over_least"] for x in runs if x["busiest_over_least"] is not None]
            med["busiest_over_least"] = statistics.median(bal) if bal else None
            med["errors"] = sum(x["errors"] for x in runs)
            out.setdefault(workload, {})[g] = med
    return out


def plot_budgets(path: Path, by_budget: dict[int, dict], workload: str) -> Path:
    """Hit rate, TTFT p50 and tokens/s of each gateway against the engines' KV budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted(by_budget)
    panels = (("hit_rate", "prefix-cache hit rate", 1.0), ("ttft_p50", "TTFT p50 ms", 1e3), ("tok_s", "output tokens/s", 1.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.5))
    for ax, (key, label, scale) in zip(axes, panels):
        for g in GATEWAYS:
            ax.plot(budgets, [by_budget[b]["medians"][workload][g][key] * scale for b in budgets], "o-", label=g)
        ax.set_xlabel("KV budget per engine, MB")
        ax.set_ylabel(f"{label} (median over rounds)")
        ax.set_ylim(bottom=0)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"prefix-aware against least-loaded placement, {workload}, two pairs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--system-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--mode", default="fpga")
    ap.add_argument("--kv-cache-mb", type=ints, default=[256],
                    help="each engine's KV budget: below the conversations' working set, least-loaded placement "
                         "keeps every conversation on both engines and their caches evict each other; several "
                         "(120,160,240) sweep it, a stack each, and plot the figures against it")
    ap.add_argument("--workloads", default="multiturn,skewed")
    ap.add_argument("--think-s", type=float, default=0.0,
                    help="multiturn: a pause of up to this many seconds between a reply and the next turn (0: the "
                         "next turn at once, which lets least-loaded keep a conversation where it just finished)")
    ap.add_argument("--name", default="fleet_routing", help="the results file's name (without .json)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    words = corpus_words()
    workloads = [(w, {"multiturn": multiturn, "skewed": skewed}[w]) for w in args.workloads.split(",")]
    by_budget = {}
    for kv_mb in args.kv_cache_mb:
        rounds = run_budget(args, kv_mb, workloads, words, out)
        by_budget[kv_mb] = {"rounds": rounds, "medians": medians(rounds)}
    rows = []
    for kv_mb, result in by_budget.items():
        for workload, by_gateway in result["medians"].items():
            for g, med in by_gateway.items():
                rows.append([kv_mb, workload, g, f"{med['hit_rate']:.2f}", f"{med['ttft_p50'] * 1e3:.0f}",
                             f"{med['ttft_p99'] * 1e3:.0f}", f"{med['tok_s']:.1f}",
                             "-" if med["busiest_over_least"] is None else f"{med['busiest_over_least']:.2f}",
                             med["errors"]])
    print(table(["KV MB", "workload", "gateway", "hit rate", "TTFT p50 ms", "p99", "tok/s", "busiest/least queue",
                 "errors"], rows))
    # one budget keeps the shape of the results before the sweep (rounds and medians at the top)
    report = ({"args": vars(args), **by_budget[args.kv_cache_mb[0]]} if len(by_budget) == 1
              else {"args": vars(args), "budgets": {str(b): r for b, r in by_budget.items()}})
    write_json(args.name, report, out)
    if len(by_budget) > 1 and "multiturn" in args.workloads.split(","):
        print("plot:", plot_budgets(out / f"{args.name}.png", by_budget, "multiturn"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
