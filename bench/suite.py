"""The three modes end to end: a grid of input x output lengths, every mode, the router's regret.

Brings the stack up (or uses a running one with --url), warms it, then for each
cell measures each forced mode and `auto` through the OpenAI HTTP API (streamed,
for TTFT and inter-token latency), `transformers` generate as the baseline, and
a load run with concurrent clients. Prints a table, writes JSON and PNG plots.

    python -m bench.suite [--quick | --full] [--url URL] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench._common import RESULTS, progress, stats, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import numpy as np  # noqa: E402

MODES = ("gpu", "fpga", "hybrid", "auto")
FORCED = ("gpu", "fpga", "hybrid")
PRESETS = {  # inputs, outputs, reps, load clients, load requests per client
    "quick": ((64, 512), (16, 64), 2, 2, 3),
    "default": ((64, 256, 512, 1024), (64, 256, 512), 2, 4, 3),
    "full": ((64, 256, 512, 1024), (64, 256, 512), 5, 8, 6),
}
# Repetitions of cells with >= LONG_OUTPUT output tokens: those are ~70% of the default's time
# (4 modes x ~20 s each), and a 512-token run already averages over 512 steps, so the default
# runs them once to fit ~15 minutes; --full runs them as often as the rest.
LONG_OUTPUT = 512
LONG_REPS = {"quick": 2, "default": 1, "full": 5}


def prompt_ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(300, 40000, n).tolist()


SALT = 1_000_003  # a run's prompt seeds are offset by a multiple of this from every other run's


def fresh_seed(base: int, run: int) -> int:
    """The seed of run `run` of the prompt `base`: the same lengths, never the same tokens. A prompt
    that ran before is a prefix-cache hit on the engines that ran it, and whichever mode came
    later would look faster than the router (which prices a fresh prompt) expects."""
    return base + run * SALT


def one_request(url: str, model: str, headers: dict, n_in: int, n_out: int, mode: str, seed: int) -> dict:
    """A streamed completion; wall-clock TTFT, inter-token gaps, e2e, and the mode that ran."""
    body = {"model": model, "prompt": prompt_ids(n_in, seed), "max_tokens": n_out, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "mode": mode}
    t0 = time.perf_counter()
    first, last, gaps, ran, usage = None, None, [], None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=1800) as r:
        if r.status_code != 200:
            raise (Unavailable if r.status_code == 503 else RuntimeError)(f"{mode} {n_in}x{n_out}: HTTP {r.status_code}: {r.read()[:300]!r}")
        ran = r.headers.get("x-hybridserve-mode")  # the final chunk's hybridserve.mode confirms it below
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("hybridserve"):
                ran = chunk["hybridserve"]["mode"]
            # only chunks that carry text time tokens: the closing chunk (finish_reason, empty text)
            # follows the last token at once and would pull the inter-token gaps down
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                if first is None:
                    first = now - t0
                elif last is not None:
                    gaps.append(now - last)
                last = now
    return {"e2e": time.perf_counter() - t0, "ttft": first, "itl": gaps, "ran": ran,
            "tokens": (usage or {}).get("completion_tokens", 0)}


def cold_auto(url: str, model: str, headers: dict, grid: list[tuple[int, int]], n: int) -> list[dict]:
    """The first `n` requests after a fresh start, all auto, cycling over the grid's cells (short
    outputs first): what a new user's router does before it has learnt anything."""
    cells = sorted(grid, key=lambda c: (c[1] >= LONG_OUTPUT, c))
    out = []
    for k in range(n):
        n_in, n_out = cells[k % len(cells)]
        progress(f"cold start: auto request {k + 1}/{n} ({n_in}x{n_out})")
        r = one_request(url, model, headers, n_in, n_out, "auto", seed=fresh_seed(n_in * 7 + n_out, 1 + k))
        out.append({"n_in": n_in, "n_out": n_out, "e2e": r["e2e"], "ran": r["ran"]})
    return out


def cold_regret(cold: list[dict], cells: list[dict]) -> float | None:
    """Time the cold auto requests took over what the best forced mode of their cell takes (medians), - 1."""
    best = {(c["n_in"], c["n_out"]): c["modes"][c["best_forced"]]["e2e"]["median"] for c in cells}
    if not cold:
        return None
    return sum(r["e2e"] for r in cold) / sum(best[(r["n_in"], r["n_out"])] for r in cold) - 1


class Unavailable(RuntimeError):
    """HTTP 503: an engine (or the link between them) is not answering yet."""


def warm_up(url: str, model: str, headers: dict, mode: str, timeout: float = 300) -> None:
    """One small request in `mode`, retried while the stack answers 503.

    The gateway's /health is 200 as soon as it reaches both engines, but decode_fpga's own
    channel to prefill_gpu (hybrid mode) can still be in gRPC's reconnect back-off then.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            one_request(url, model, headers, 32, 4, mode, seed=7)
            return
        except Unavailable as exc:
            if time.monotonic() > deadline:
                raise
            progress(f"{exc}; retrying")
            time.sleep(2)


def transformers_baseline(cells, reps: int) -> dict:
    import copy

    import torch

    from services.model.checkpoint import locate
    from services.model.reference import load_reference

    model = load_reference(locate(None))
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = -1, 0, False  # never stop early: like ignore_eos
    gc.max_new_tokens = 2
    with torch.no_grad():  # warm-up: the first generate call pays one-off set-up costs
        model.generate(torch.tensor([prompt_ids(16, 1)]), generation_config=gc)
    out = {}
    for n_in, n_out in cells:
        gc.max_new_tokens = n_out
        times = []
        for r in range(reps):
            progress(f"transformers {n_in}x{n_out} ({r + 1}/{reps})")
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(torch.tensor([prompt_ids(n_in, 1)]), generation_config=gc)
            times.append(time.perf_counter() - t)
        out[(n_in, n_out)] = stats(times)
    return out


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def load_run(url, model, headers, inputs, outputs, clients: int, per_client: int) -> dict:
    """Each mode in turn: `clients` concurrent clients, each sending a mix of lengths."""
    mix = [(i, o) for i in inputs for o in outputs if o <= 64] or [(inputs[0], outputs[0])]
    res = {}
    for mode in MODES:
        progress(f"load run: {mode}, {clients} clients x {per_client} requests")
        lock, ttft, itl, tokens = threading.Lock(), [], [], [0]

        def client(c: int) -> None:
            for k in range(per_client):
                n_in, n_out = mix[(c + k) % len(mix)]
                r = one_request(url, model, headers, n_in, n_out, mode,
                                seed=fresh_seed(100 + c * 31 + k, 1000 + MODES.index(mode)))
                with lock:
                    ttft.append(r["ttft"])
                    itl.extend(r["itl"])
                    tokens[0] += r["tokens"]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))
        wall = time.perf_counter() - t0
        res[mode] = {"throughput_tok_s": tokens[0] / wall, "wall_s": wall, "tokens": tokens[0],
                     **{f"ttft_p{q}": percentile(ttft, q) for q in (50, 95, 99)},
                     **{f"itl_p{q}": percentile(itl, q) for q in (50, 95, 99)}}
    return res


def plots(out: Path, cells: list[dict], load: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    labels = [f"{c['n_in']}→{c['n_out']}" for c in cells]
    x = np.arange(len(cells))
    fig, ax = plt.subplots(figsize=(max(8, len(cells) * 1.1), 4.5))
    for i, mode in enumerate(MODES):
        ys = [c["modes"][mode]["e2e"]["median"] for c in cells]
        ax.bar(x + (i - 1.5) * 0.2, ys, 0.2, label=mode)
    for j, c in enumerate(cells):
        pick = c["auto_picked"]
        if pick in FORCED:
            k = FORCED.index(pick)
            ax.plot(x[j] + (k - 1.5) * 0.2, c["modes"][pick]["e2e"]["median"], "kv", ms=7,
                    label="router's pick" if j == 0 else None)
    if all("transformers_s" in c for c in cells):
        ax.plot(x, [c["transformers_s"]["median"] for c in cells], "k_", ms=18, mew=2, label="transformers")
    ax.set_xticks(x, labels, rotation=30)
    ax.set_ylabel("end-to-end seconds (median)")
    ax.set_xlabel("input tokens → output tokens")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Latency per cell and mode")
    fig.tight_layout()
    paths.append(out / "suite_latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(8, len(cells) * 0.9), 3.5))
    ax.bar(x, [100 * c["auto_regret"] for c in cells], color="tab:purple")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x, labels, rotation=30)
    ax.set_ylabel("auto vs best forced mode (%)")
    ax.set_title("Router regret per cell (lower is better)")
    fig.tight_layout()
    paths.append(out / "suite_regret.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, metric in zip(axes, ("ttft", "itl")):
        for i, q in enumerate((50, 95, 99)):
            ax.bar(np.arange(len(MODES)) + (i - 1) * 0.25, [(load[m][f"{metric}_p{q}"] or 0) * 1e3 for m in MODES],
                   0.25, label=f"p{q}")
        ax.set_xticks(np.arange(len(MODES)), MODES)
        ax.set_ylabel("ms")
        ax.set_title(f"load run: {metric.upper()}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "suite_load.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="a few minutes")
    g.add_argument("--full", action="store_true", help="more repetitions and clients")
    ap.add_argument("--url", help="use a running gateway instead of starting the stack")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--inputs", help="comma-separated input lengths (overrides the preset)")
    ap.add_argument("--outputs", help="comma-separated output lengths (overrides the preset)")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--long-reps", type=int, help=f"repetitions of cells with >= {LONG_OUTPUT} output tokens")
    ap.add_argument("--load-clients", type=int)
    ap.add_argument("--load-requests", type=int, help="requests per client in the load run")
    ap.add_argument("--no-baseline", action="store_true", help="skip transformers")
    ap.add_argument("--cold-requests", type=int, default=20,
                    help="auto requests sent first, right after start-up, for the cold regret (0: none)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    preset = "quick" if args.quick else "full" if args.full else "default"
    inputs, outputs, reps, clients, per_client = PRESETS[preset]
    inputs = tuple(int(v) for v in args.inputs.split(",")) if args.inputs else inputs
    outputs = tuple(int(v) for v in args.outputs.split(",")) if args.outputs else outputs
    long_reps = args.long_reps or (args.reps or LONG_REPS[preset])
    reps = args.reps or reps
    clients, per_client = args.load_clients or clients, args.load_requests or per_client
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    stack = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        from bench._stack import start_stack

        stack = start_stack(out / "suite_stack.log")
        url = stack.url
    try:
        model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        grid = [(i, o) for i in inputs for o in outputs]
        cold = cold_auto(url, model, headers, grid, args.cold_requests)  # before anything else teaches the router
        progress("warming up every mode")
        for mode in MODES:
            warm_up(url, model, headers, mode)
        cells = []
        for k, (n_in, n_out) in enumerate(grid):
            runs = {m: [] for m in MODES}
            cell_reps = long_reps if n_out >= LONG_OUTPUT else reps
            for r in range(cell_reps):
                for mode in MODES:  # interleaved, so drift hits every mode alike
                    progress(f"cell {k + 1}/{len(grid)} {n_in}x{n_out}: {mode} ({r + 1}/{cell_reps})")
                    seed = fresh_seed(n_in * 7 + n_out, 100 + r * len(MODES) + MODES.index(mode))
                    runs[mode].append(one_request(url, model, headers, n_in, n_out, mode, seed))
            cell = {"n_in": n_in, "n_out": n_out, "modes": {}}
            for mode, rs in runs.items():
                itl = [g for x in rs for g in x["itl"]]
                cell["modes"][mode] = {"e2e": stats([x["e2e"] for x in rs]), "ttft": stats([x["ttft"] for x in rs]),
                                       "itl_median": statistics.median(itl) if itl else None,
                                       "ran": [x["ran"] for x in rs]}
            best = min(FORCED, key=lambda m: cell["modes"][m]["e2e"]["median"])
            picks = cell["modes"]["auto"]["ran"]
            cell["best_forced"] = best
            cell["auto_picked"] = max(set(picks), key=picks.count)
            cell["auto_regret"] = cell["modes"]["auto"]["e2e"]["median"] / cell["modes"][best]["e2e"]["median"] - 1
            cells.append(cell)
        load = load_run(url, model, headers, inputs, outputs, clients, per_client)
    finally:
        if stack is not None:
            stack.stop()
    if not args.no_baseline:
        base = transformers_baseline(grid, max(1, reps // 2))
        for c in cells:
            c["transformers_s"] = base[(c["n_in"], c["n_out"])]
            best_s = c["modes"][c["best_forced"]]["e2e"]["median"]
            c["speedup_best_vs_transformers"] = c["transformers_s"]["median"] / best_s
    regrets = [c["auto_regret"] for c in cells]
    summary = {"regret_mean": float(np.mean(regrets)), "regret_worst": float(np.max(regrets)),
               "regret_cold": cold_regret(cold, cells), "cold_requests": len(cold),
               "cold_ran": [r["ran"] for r in cold]}
    rows = [[f"{c['n_in']}x{c['n_out']}", *[f"{c['modes'][m]['e2e']['median']:.2f}" for m in MODES], c["best_forced"],
             c["auto_picked"], f"{100 * c['auto_regret']:+.1f}%",
             f"{c['transformers_s']['median']:.2f}" if "transformers_s" in c else "-",
             f"{c['speedup_best_vs_transformers']:.2f}x" if "speedup_best_vs_transformers" in c else "-"]
            for c in cells]
    print(table(["in x out", "gpu s", "fpga s", "hybrid s", "auto s", "best", "auto ran", "regret", "transformers s",
                 "best vs hf"], rows))
    print(f"router regret: mean {100 * summary['regret_mean']:+.1f}%, worst {100 * summary['regret_worst']:+.1f}% "
          f"(warm: medians of {reps} interleaved runs per mode and cell, {long_reps} for >= {LONG_OUTPUT} output tokens)")
    if summary["regret_cold"] is not None:
        ran = ", ".join(f"{m} {summary['cold_ran'].count(m)}" for m in FORCED)
        print(f"router regret cold: {100 * summary['regret_cold']:+.1f}% over the first {len(cold)} requests after "
              f"{'start-up' if stack is not None else 'connecting (a running stack: not a fresh start)'}, "
              f"against each cell's best forced median; ran {ran}")
    print(table(["load: mode", "tok/s", "TTFT p50 ms", "p95", "p99", "ITL p50 ms", "p95", "p99"],
                [[m, f"{v['throughput_tok_s']:.1f}", *[f"{(v[f'ttft_p{q}'] or 0) * 1e3:.0f}" for q in (50, 95, 99)],
                  *[f"{(v[f'itl_p{q}'] or 0) * 1e3:.1f}" for q in (50, 95, 99)]] for m, v in load.items()]))
    pngs = plots(out, cells, load)
    for p in pngs:
        print(f"wrote {p}")
    write_json("suite", {"reps": reps, "long_reps": long_reps, "long_output": LONG_OUTPUT, "inputs": inputs, "outputs": outputs, "modes": MODES, "cells": cells,
                         "load": {"clients": clients, "requests_per_client": per_client, "results": load},
                         "summary": summary, "plots": [p.name for p in pngs]}, out_dir=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
