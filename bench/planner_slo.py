"""The planner against its own targets, end to end: `hybridserve up --autoscale --max-prefill 2 --max-decode 3`
under open-loop Poisson arrivals at rising rates, then closed loops of clients.

For each phase it reports the clients' TTFT and ITL (p50, p99) against the planner's targets (its
defaults, TTFT 2 s and ITL 0.1 s, unless given), and from `GET /debug/planner` read every second: the
desired replicas of each pool (and the capacity model's and the latency floor's parts), the engines
serving, and the time from the planner's first observed miss to a new engine of that pool serving.
The holds and cooldown are shortened (`--up-hold-s`, `--cooldown-s`) so a short run shows the steps.

On a machine whose cores every engine shares (2 cores here), extra engines add no capacity: the
figures then show what the planner asks for and how fast `up` acts on it, not a latency that falls.

    python -m bench.planner_slo [--rates 0.5,1,2] [--clients 4,16,32] [--phase-s 30]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path


import httpx  # noqa: E402
from bench._common import RESULTS, progress, table, write_json  # noqa: E402
from bench._stack import start_stack  # noqa: E402
from bench.serving.client import Target, async_client, one_request, served_model, warm_up  # noqa: E402
from bench.serving.probe import Periodic  # noqa: E402
from bench.serving.report import command_line  # noqa: E402
from bench.serving.stats import summarize  # noqa: E402
from bench.serving.workload import Salter, corpus_ids, salt_seed, workload  # noqa: E402

from services.gateway.settings import GatewaySettings  # noqa: E402
from services.launcher.stack import UpSettings  # noqa: E402

POOLS = ("prefill", "decode")


class PlanWatch(Periodic):
    """`GET /debug/planner` every second while the load is on: one row per read."""

    interval_s = 1.0

    def __init__(self, url: str, t0: float):
        self.url, self.t0, self.rows, self.phase = url, t0, [], ""

    def sample(self) -> None:
        try:
            plan = httpx.get(self.url + "/debug/planner", timeout=5, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            return  # the gateway is busy past 5 s: a gap in the series, not a failure
        row = {"t": round(time.monotonic() - self.t0, 2), "phase": self.phase}
        for pool in POOLS:
            lat = plan["latency"][pool]
            row[pool] = {"desired": plan["desired"][pool], "model": plan["model"][pool], "floor": lat["floor"],
                         "ratio": lat["ratio"], "ttft_p50": lat["ttft_p50_s"], "itl_p50": lat["itl_p50_s"],
                         "serving": sum(m["up"] and not m["draining"] for m in plan["pools"][pool])}
        self.rows.append(row)


def miss_to_serving(rows: list[dict]) -> list[dict]:
    """Per pool, each first observed miss (the planner's p50 over its target) and when the pool next
    had more engines serving: the seconds between, as the planner's reads saw them."""
    out = []
    for pool in POOLS:
        pending = None
        for r in rows:
            p = r[pool]
            if pending is None and p["ratio"] is not None and p["ratio"] > 1:
                pending = (r["t"], p["serving"], r["phase"])
            elif pending is not None and p["serving"] > pending[1]:
                out.append({"pool": pool, "phase": pending[2], "missed_at_s": pending[0], "serving_at_s": r["t"],
                            "seconds": round(r["t"] - pending[0], 2), "engines": f"{pending[1]}->{p['serving']}"})
                pending = None
        if pending is not None:
            out.append({"pool": pool, "phase": pending[2], "missed_at_s": pending[0], "serving_at_s": None,
                        "seconds": None, "engines": f"{pending[1]}->"})
    return out


async def open_loop(target: Target, reqs, rate: float, duration: float, rng: random.Random) -> list[dict]:
    """Poisson arrivals at `rate` per second for `duration` s; every request is awaited to its end."""
    async with async_client(256) as client:
        tasks, t0, at = [], time.perf_counter(), rng.expovariate(rate)
        while at < duration:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(client, target, *next(reqs))))
            at += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


async def closed_loop_for(target: Target, reqs, clients: int, duration: float) -> list[dict]:
    """`clients` clients, each sending its next request when one ends, until `duration` s have passed."""
    results: list[dict] = []
    async with async_client(clients) as client:
        end = time.perf_counter() + duration

        async def worker() -> None:
            while time.perf_counter() < end:
                results.append(await one_request(client, target, *next(reqs)))
        await asyncio.gather(*(worker() for _ in range(clients)))
    return results


def phase_row(name: str, s: dict, rows: list[dict], ttft_s: float, itl_s: float) -> list:
    seen = [r for r in rows if r["phase"] == name]
    mx = lambda pool, key: max((r[pool][key] for r in seen), default=None)  # noqa: E731
    fmt = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
    return [name, s["requests"], s["errors"], fmt(s["ttft_p50"]), fmt(s["ttft_p99"]),
            "MISS" if (s["ttft_p50"] or 0) > ttft_s else "ok", fmt(s["itl_p50"]), fmt(s["itl_p99"]),
            "MISS" if (s["itl_p50"] or 0) > itl_s else "ok",
            f"{mx('prefill', 'desired')}/{mx('decode', 'desired')}", f"{mx('prefill', 'model')}/{mx('decode', 'model')}",
            f"{mx('prefill', 'serving')}/{mx('decode', 'serving')}"]


def plot(path: Path, rows: list[dict], phases: list[tuple[str, float, float]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    t = [r["t"] for r in rows]
    for pool, color in zip(POOLS, ("tab:blue", "tab:orange")):
        axes[0].step(t, [r[pool]["desired"] for r in rows], where="post", color=color, label=f"{pool} desired")
        axes[0].step(t, [r[pool]["serving"] for r in rows], where="post", color=color, ls="--",
                     label=f"{pool} serving")
        axes[0].step(t, [r[pool]["model"] for r in rows], where="post", color=color, ls=":", label=f"{pool} model")
        axes[1].plot(t, [r[pool]["ratio"] if r[pool]["ratio"] is not None else float("nan") for r in rows],
                     color=color, label=f"{pool} observed p50 / target")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    for name, a, b in phases:
        for ax in axes:
            ax.axvspan(a, b, alpha=0.06, color="grey")
        axes[0].text(a, axes[0].get_ylim()[1] * 0.95, name, fontsize=7, va="top")
    axes[0].set_ylabel("engines")
    axes[1].set_ylabel("p50 / target")
    axes[1].set_xlabel("seconds")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("planner: desired and serving engines, observed latency against the targets")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.5,1,2", help="open-loop Poisson arrival rates (requests/s), in order")
    ap.add_argument("--clients", default="4,16,32", help="closed-loop client counts, in order")
    ap.add_argument("--phase-s", type=float, default=30.0)
    ap.add_argument("--prompt", default="64,128")
    ap.add_argument("--output", default="32,64")
    ap.add_argument("--window-s", type=float, default=20.0, help="the planner's window")
    ap.add_argument("--up-hold-s", type=float, default=5.0)
    ap.add_argument("--cooldown-s", type=float, default=10.0)
    ap.add_argument("--down-hold-s", type=float, default=60.0)
    ap.add_argument("--ttft-s", type=float, default=2.0)
    ap.add_argument("--itl-s", type=float, default=0.1)
    ap.add_argument("--settle-s", type=float, default=45.0, help="no load after the phases (under the down hold)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {UpSettings.env_name("prefill_engines"): "1", UpSettings.env_name("decode_engines"): "1",
           UpSettings.env_name("autoscale"): "true", UpSettings.env_name("max_prefill_engines"): "2",
           UpSettings.env_name("max_decode_engines"): "3", UpSettings.env_name("autoscale_interval_s"): "1",
           UpSettings.env_name("scale_up_hold_s"): str(args.up_hold_s),
           UpSettings.env_name("scale_cooldown_s"): str(args.cooldown_s),
           UpSettings.env_name("scale_down_hold_s"): str(args.down_hold_s),
           GatewaySettings.env_name("planner_ttft_s"): str(args.ttft_s),
           GatewaySettings.env_name("planner_itl_s"): str(args.itl_s),
           GatewaySettings.env_name("planner_window_s"): str(args.window_s),
           "HYBRIDSERVE_PREFILL_KV_CACHE_MB": "256", "HYBRIDSERVE_DECODE_KV_CACHE_MB": "256",
           # an engine the scaler starts reuses the first one's profile, busy or not (a sweep of its own on a
           # loaded host took over two minutes: the run was over before it served)
           "HYBRIDSERVE_PROFILE_KEEP_BUSY": "true"}
    corpus, _ = corpus_ids()
    seed = salt_seed(args.seed)
    reqs_list = workload(corpus, 4000, seed, tuple(map(int, args.prompt.split(","))),
                         tuple(map(int, args.output.split(","))))
    salter = Salter(seed)
    reqs = ((salter(p), n) for p, n in reqs_list)
    phases = [(f"open {r}/s", "open", float(r)) for r in args.rates.split(",")] + \
             [(f"closed {c}", "closed", int(c)) for c in args.clients.split(",")]
    stack = start_stack(out / "planner_slo_up.log", env, engines_per_kind=3)
    try:
        target = Target("auto", stack.url, {}, served_model(stack.url))
        warm_up(target, corpus[:64], progress=progress)
        t0 = time.monotonic()
        spans, summaries = [], {}
        with PlanWatch(stack.url, t0) as watch:
            for name, kind, level in phases:
                watch.phase = name
                progress(f"{name} for {args.phase_s:g} s")
                a = time.monotonic()
                if kind == "open":
                    results = asyncio.run(open_loop(target, reqs, level, args.phase_s, random.Random(seed + len(spans))))
                else:
                    results = asyncio.run(closed_loop_for(target, reqs, level, args.phase_s))
                b = time.monotonic()
                spans.append((name, a - t0, b - t0))
                summaries[name] = summarize(results, b - a)
            watch.phase = "settle"  # no load: engines still starting come up (within the down hold)
            progress(f"no load for {args.settle_s:g} s: engines being started may still join")
            time.sleep(args.settle_s)
        rows = watch.rows
    finally:
        stack.stop()
    headers = ["phase", "requests", "errors", "TTFT p50", "TTFT p99", f"vs {args.ttft_s:g} s", "ITL p50", "ITL p99",
               f"vs {args.itl_s:g} s", "desired P/D (max)", "model P/D (max)", "serving P/D (max)"]
    print(table(headers, [phase_row(n, summaries[n], rows, args.ttft_s, args.itl_s) for n, _, _ in spans]))
    steps = miss_to_serving(rows)
    print("\nfrom the planner's first observed miss to a new engine of the pool serving:")
    print(table(["pool", "phase", "missed at s", "serving at s", "seconds", "engines"],
                [[s["pool"], s["phase"], s["missed_at_s"], s["serving_at_s"] if s["serving_at_s"] is not None else "never",
                  s["seconds"] if s["seconds"] is not None else "-", s["engines"]] for s in steps]))
    print("\n(on a machine whose cores every engine shares, extra engines add no capacity: the figures show what "
          "the planner asks for and how fast `up` acts, not a latency that falls)")
    write_json("planner_slo", {"command": command_line(), "args": vars(args), "seed": seed, "phases": spans,
                               "summaries": summaries, "planner": rows, "miss_to_serving": steps}, out)
    plot(out / "planner_slo.png", rows, spans)
    return 0


if __name__ == "__main__":
    sys.exit(main())
