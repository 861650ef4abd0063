"""Prefill on one host, the KV imported on another: the exposed hand-off over a shaped link, per way of sending.

Two network namespaces made here (`hs-tx-<pid>`, `hs-rx-<pid>`) joined by a veth pair with addresses in
10.231.0.0/30; both ends get a tbf at R (1 and 10 Gbit/s) under netem's 0.5 ms delay; a kernel without
sch_netem (this machine's: CONFIG_NET_SCH_NETEM is not set) gets the tbf alone, and the JSON's `delay`
says so. The bench goes on as a process of `hs-tx` (`ip netns exec`: UCX, which lists /sys/class/net,
sees that namespace's veth), and a receiving process in `hs-rx` listens on 10.231.0.2 and imports each
request's KV into host memory the way decode does (a [layers, 2, kv_heads, n, dim] buffer, layer and
token slice at a time, services/kv/tcp.py). In `hs-tx` the torch engine (the real model, paged pool,
`step`) prefills each prompt and streams its KV:

    local   prefill in one step, nothing sent (the reference: KV already where decode is)
    whole   prefill in one step, then every layer in one frame
    layers  prefill in one step, each layer sent as soon as it is computed (the on_layer hook)
    u<S>    prefill in S-token slices (chunked prefill), each slice's KV streamed layer by layer as it
            computes: frames of (layer, token range), sent while the engine goes on
    dp      the same with the slice lengths from the DP (services/kv/slicing.py, layers = the model's)
            over t(slice, context) = a + b n + c n ctx + d n^2 fitted to step times measured on this
            engine (slices of 64..1024 tokens after contexts up to the longest prompt, exporting their
            KV as the slice modes do), and the link's nominal rate and 0.5 ms

Per (link, prompt) cell, `--reps` rounds; each round runs every mode once, local included, in an
order rotated from round to round. Two figures per mode, medians over the rounds, with their spread
(max - min):

    e2e      prefill start -> the last KV byte imported on the decode side (decode's first step would
             start there; it is the same for every mode and is not run)
    exposed  e2e - that round's local prefill: the hand-off's cost as the issue defines it (time from
             the end of prefill to the KV on the decode side, against a local run); it charges the
             slice modes for the compute slicing adds as well as for the bytes still in flight

DP vs the best uniform slicing (lowest median exposed) per cell: "yes" when the DP's median is not
above it, "within spread" when the difference is inside the larger of the two spreads, else "no".
Both namespaces share the host's clock. Traffic stays on the veth pair inside the two namespaces.
`--transports tcp,nixl` adds nixl's layers and uniform slicings beside tcp's (nixl:layers, nixl:u256);
`--one-host` (no namespaces: loopback, unshaped, no root) also takes `shm`, layer by layer (shm:layers).
Needs root (ip netns, tc); exits with a clear message otherwise. The namespaces are deleted on any exit.

    sudo python -m bench.cross_host --fit-only --sizes 4096 --out cross_host_costs   # the cost model
    sudo python -m bench.cross_host --costs cross_host_costs --sizes 1024 --links 1,10 --reps 3 --out cross_host_1024
    python -m bench.cross_host --merge cross_host_256,cross_host_1024,...   # one table, JSON and plot
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from bench._common import RESULTS, ROOT, progress, write_json
from bench.cross_host_net import RX_ADDR, HostImporter, Netns, _enter, run_in_tx, selftest  # noqa: F401
from bench.cross_host_report import merge, plot, report, verdict  # noqa: F401
from bench.cross_host_transports import OneHost, close_arena, make_sender, port_of, receive, ucx_env

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TIMEOUT_S = 60.0
GRANULE = 64  # DP slice lengths are multiples of this (four 16-token blocks)


# ---- the prefilling host ----------------------------------------------------------------------------
class Prefiller:
    """The torch engine over its paged pool; one prompt at a time in blocks [0, n / block_size)."""

    def __init__(self, max_tokens: int, pool_tokens: int):
        from services.engine.batching_settings import BatchingSettings
        from services.model.loading import load_model
        from services.prefill_gpu.engine import TorchEngine

        loaded = load_model(None)
        self.cfg = loaded.config
        kv_mb = 1 + pool_tokens * self.cfg.n_layers * 2 * self.cfg.n_kv_heads * self.cfg.head_dim * 4 // (1 << 20)
        self.engine = TorchEngine(loaded.config, loaded.weights, device="auto",
                                  batching=BatchingSettings(kv_cache_mb=kv_mb + 8, max_num_batched_tokens=max_tokens))
        self.table = tuple(range(self.engine.num_blocks))
        self.engine.kv_pool.data.zero_()

    def chunk(self, tokens, start, stop):
        from services.engine.scheduler import ScheduledChunk

        return ScheduledChunk(seq_id=1, start=start, token_ids=tuple(tokens[start:stop]), block_table=self.table,
                              samples=stop == len(tokens), sampling_params=None)

    def export(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """Positions [start, stop) of one layer in wire layout [2, kv_heads, stop - start, dim] (an engine call
        this bench needs: export_kv_blocks takes [0, n) only)."""
        pool = self.engine.kv_pool
        return pool.gather(layer, pool.index(pool.slots(self.table, start, stop)))  # [2, kvh, n, dim]

    def step(self, tokens, start, stop, on_layer=None) -> int:
        out = self.engine.step([self.chunk(tokens, start, stop)], greedy=True, on_layer=on_layer)
        return out[0] if stop == len(tokens) else -1

    def sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()


def cost_grid(max_tokens: int, lengths) -> list[tuple[int, int]]:
    """(slice length, context) points to measure: each length after contexts 0, 1/4, 1/2, 3/4 of the
    longest prompt (so the fit sees the attention term where the DP's slices will be)."""
    contexts = sorted({0, *(k * max_tokens // 4 for k in (1, 2, 3))})
    return [(n, c) for n in lengths for c in contexts if n + c <= max_tokens]


def measure_costs(p: Prefiller, grid, reps: int = 2) -> list[tuple[int, int, float]]:
    """t(slice length, context) on this engine: the median of `reps` steps at each grid point, each
    step exporting its KV slice layer by layer into host memory as the slice modes do."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, p.cfg.vocab_size, max(n + c for n, c in grid)).tolist()
    p.step(tokens, 0, GRANULE)  # warm-up: the first step pays for allocations
    sink = {}
    points = []
    for n, c in grid:
        def export(layer, c=c, n=n):
            sink[layer] = p.export(layer, c, c + n).cpu().numpy().copy()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            p.engine.step([p.chunk(tokens[: c + n], c, c + n)], greedy=True, on_layer=export)
            p.sync()
            ts.append(time.perf_counter() - t0)
        points.append((n, c, statistics.median(ts)))
        progress(f"t({n}, ctx {c}) = {points[-1][2]:.3f} s")
    return points


def fit_costs(points) -> dict:
    """The fitted model and how far it is from what was measured."""
    from services.kv.slicing import PrefillCost

    model = PrefillCost.fit(points)
    errs = model.relative_errors(points)
    progress("t(n, ctx) = {a_s:.4g} + {b_s_per_token:.4g} n + {c_s_per_token_ctx:.4g} n ctx + "
             "{d_s_per_token2:.4g} n^2 s".format(**model.to_json()))
    progress(f"relative error on the {len(points)} points: median {statistics.median(map(abs, errs)):.1%}, "
             f"max {max(map(abs, errs)):.1%}")
    return {"model": model.to_json(), "points": [list(pt) for pt in points],
            "relative_errors": errs, "max_abs_relative_error": max(map(abs, errs))}


def run_handoff(p: Prefiller, control, address, tokens, mode, slices=None, transport="tcp") -> dict:
    """One prompt prefilled and sent as `mode` says over `transport`; the receiver's outcome and the times."""
    from services.kv.handoff import PrefillDone
    from services.kv.header import SlotHeader, request_nonce

    n, cfg = len(tokens), p.cfg
    request = f"bench-{mode}-{n}-{time.monotonic_ns()}"
    control.write(json.dumps({"n_tokens": n, "request": request, "dtype": "fp32", "transport": transport}) + "\n")
    control.flush()
    if control.readline().strip() != "ready":
        raise RuntimeError("the receiver did not get ready")
    header = SlotHeader("fp32", cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n, cfg.model_id,
                        nonce=request_nonce(request))
    L = cfg.n_layers
    with make_sender(transport, (address[0], port_of(transport, address[1])), header) as tx:
        tx.open()
        t0, cpu0 = time.time(), time.process_time()
        if mode in ("whole", "layers"):
            def send_layer(layer):
                tx.layer_buffer(layer)[...] = p.export(layer, 0, n).cpu().numpy()
                tx.layer_written(layer)
            first = p.step(tokens, 0, n, on_layer=send_layer if mode == "layers" else None)
            p.sync()
            compute_end = time.time()
            if mode == "whole":
                for layer in range(L):
                    tx.layer_buffer(layer)[...] = p.export(layer, 0, n).cpu().numpy()
                tx.send_slice(0, L, 0, n)
        else:  # each slice streams layer by layer as it computes: frames (layer, token range)
            a = 0
            for s in slices:
                def send_layer(layer, a=a, s=s):
                    tx.layer_buffer(layer)[:, :, a:a + s] = p.export(layer, a, a + s).cpu().numpy()
                    tx.send_slice(layer, layer + 1, a, a + s)
                first = p.step(tokens, a, a + s, on_layer=send_layer)
                a += s
            p.sync()
            compute_end = time.time()
        imported_at = tx.finish(PrefillDone(first, compute_end - t0, 0.0, compute_end))
        cpu = time.process_time() - cpu0  # every thread of this process: the prefill and the transport's
    out = json.loads(control.readline())
    if not out.get("ok"):
        raise RuntimeError(f"the receiver failed: {out.get('error')}")
    return {"mode": mode, "transport": transport, "n_tokens": n, "slices": list(slices) if slices else None,
            "first_token": first, "cpu_s": cpu, "rx_cpu_s": out["cpu_s"],
            "start": t0, "compute_s": compute_end - t0, "imported_after_s": imported_at - t0,
            "tail_s": imported_at - compute_end, "bytes": out["bytes"], "checksum": out["checksum"]}


def run_local(p: Prefiller, tokens) -> dict:
    """The prompt prefilled in one step, nothing sent: the KV is where decode would be when it ends."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    first = p.step(tokens, 0, len(tokens))
    p.sync()
    e2e, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"mode": "local", "n_tokens": len(tokens), "slices": None, "first_token": first, "compute_s": e2e,
            "imported_after_s": e2e, "tail_s": 0.0, "bytes": 0, "cpu_s": cpu, "rx_cpu_s": 0.0}


def load_or_fit_costs(args, p: Prefiller | None) -> dict:
    if args.costs:
        saved = json.loads((RESULTS / f"{args.costs}.json").read_text())
        return {**saved["costs"], "from": args.costs, "command": saved["command"]}
    lengths = [int(x) for x in args.cost_lengths.split(",")]
    grid = cost_grid(max(int(x) for x in args.sizes.split(",")), lengths)
    progress(f"measuring t(slice, context) on the engine at {len(grid)} points")
    return {**fit_costs(measure_costs(p, grid, args.cost_reps)), "command": _command()}


def _command() -> str:
    argv = sys.argv[1:]
    if "--in-netns" in argv:  # run_in_tx's own addition: not part of the command that was typed
        i = argv.index("--in-netns")
        argv = argv[:i] + argv[i + 2:]
    return "python -m bench.cross_host " + " ".join(argv)


def bench(args) -> None:
    from services.kv.slicing import Link, PrefillCost, best_slices, pipeline_time, uniform_slices

    sizes = [int(x) for x in args.sizes.split(",")]
    uniform = [int(x) for x in args.uniform.split(",")]
    links = [float(x) for x in args.links.split(",")]
    max_len = max(int(x) for x in args.cost_lengths.split(","))
    p = Prefiller(max(max(sizes), max_len), max(sizes) + max_len)
    costs = load_or_fit_costs(args, p)
    if args.fit_only:
        write_json(args.out, {"device": p.engine.device_name, "granule": GRANULE, "costs": costs,
                              "command": _command()})
        return
    model = PrefillCost.from_json(costs["model"])
    bpt = p.cfg.n_layers * 2 * p.cfg.n_kv_heads * p.cfg.head_dim * 4  # fp32 wire bytes per token
    L = p.cfg.n_layers
    records, dp_plans, verdicts = [], {}, {}
    rng = np.random.default_rng(1)
    prompts = {n: rng.integers(3, p.cfg.vocab_size, n).tolist() for n in sizes}
    p.step(prompts[sizes[0]], 0, min(sizes[0], GRANULE))  # warm-up
    rx_addr, extra = ("127.0.0.1", [t for t in args.transports.split(",") if t != "tcp"])
    with OneHost() if args.one_host else Netns(rate=None, names=args.in_netns) as ns:
        rx_addr = rx_addr if args.one_host else RX_ADDR
        port = 47000 + os.getpid() % 1000
        rx = subprocess.Popen([*ns.exec_in(ns.rx), sys.executable, "-m", "bench.cross_host", "--receive",
                               rx_addr, str(port)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **ucx_env(getattr(ns, "veth_rx", None))})
        try:
            if rx.stdout.readline().strip() != "listening":
                raise RuntimeError("the receiving process did not start")
            # this process runs in the tx namespace already (run_in_tx): UCX sees the veth, not the host's devices
            os.environ.update(ucx_env(getattr(ns, "veth_tx", None)))  # before this process's NIXL agent exists
            control = socket.create_connection((rx_addr, port), timeout=TIMEOUT_S).makefile("rw")
            for gbit in [0.0] if args.one_host else links:  # 0: one host, loopback, unshaped
                ns.shape(f"{gbit:g}gbit")
                delay, no_delay = ns.delay, ns.no_delay_reason
                link = Link((gbit or 22) * 1e9 / 8 * 0.94, 0.5e-3 + 50e-6)  # TCP/IP overhead; one host: ~22 Gbit/s
                for n in sizes:
                    dp, dp_t = best_slices(n, model, link, bpt, granule=GRANULE, layers=L)
                    plans = [("local", None), ("whole", None), ("layers", None)]
                    plans += [(f"u{s}", uniform_slices(n, s)) for s in uniform if s < n]
                    plans.append(("dp", dp))
                    predicted = {"local": model(n, 0), "whole": pipeline_time([n], model, link, bpt, 1),
                                 "layers": pipeline_time([n], model, link, bpt, L),
                                 **{m: pipeline_time(sl, model, link, bpt, L) for m, sl in plans[3:]}}
                    # the other transports: layer by layer and the uniform slicings ("nixl:u256"), the same plans
                    plans += [(f"{t}:{m}", sl) for t in extra for m, sl in plans[2:]
                              if m != "dp" and (t != "shm" or m == "layers")]  # the arena: whole layers only
                    predicted.update({m: predicted[m.split(":")[1]] for m, _ in plans if ":" in m})
                    dp_plans[f"{gbit:g}/{n}"] = {"slices": dp, "predicted_s": dp_t}
                    progress(f"{gbit:g} Gbit/s, {n} tokens: DP slices {dp} (predicted {dp_t:.3f} s; "
                             f"one step predicted {model(n, 0):.3f} s)")
                    runs = {m: [] for m, _ in plans}
                    for rep in range(args.reps):
                        k = rep % len(plans)
                        for mode, slices in plans[k:] + plans[:k]:  # every mode once a round, order rotated
                            if mode == "local":
                                r = run_local(p, prompts[n])
                            else:
                                t, base = mode.split(":") if ":" in mode else ("tcp", mode)
                                r = run_handoff(p, control, (rx_addr, port + 1), prompts[n],
                                                base if slices is None else "slices", slices, t)
                            runs[mode].append(r)
                        local_s, local_cpu = runs["local"][-1]["imported_after_s"], runs["local"][-1]["cpu_s"]
                        for mode, _ in plans:
                            runs[mode][-1]["exposed_s"] = runs[mode][-1]["imported_after_s"] - local_s
                            runs[mode][-1]["cpu_over_local_s"] = runs[mode][-1]["cpu_s"] - local_cpu
                        progress(f"{gbit:g} Gbit/s, {n} tokens, round {rep + 1}/{args.reps}: local {local_s:.3f} s, "
                                 + ", ".join(f"{m} {runs[m][-1]['exposed_s'] * 1e3:+.0f} ms" for m, _ in plans[1:]))
                    firsts = {r["first_token"] for rs in runs.values() for r in rs}
                    if len(firsts) != 1:
                        raise RuntimeError(f"{n} tokens: the modes disagree on the first token: {firsts}")
                    local_med = statistics.median(r["imported_after_s"] for r in runs["local"])
                    cell = []
                    for mode, slices in plans:
                        rec = {"gbit": gbit, "n_tokens": n, "mode": mode, "slices": slices,
                               "predicted_s": predicted[mode], "reps": len(runs[mode]), "local_prefill_s": local_med,
                               "first_token": runs[mode][0]["first_token"], "runs": runs[mode]}
                        for key in ("imported_after_s", "exposed_s", "compute_s", "tail_s", "cpu_over_local_s",
                                    "rx_cpu_s"):
                            xs = [r[key] for r in runs[mode]]
                            rec[key] = statistics.median(xs)
                            rec[key.removesuffix("_s") + "_spread_s"] = max(xs) - min(xs)
                        rec["e2e_s"], rec["e2e_spread_s"] = rec.pop("imported_after_s"), rec.pop("imported_after_spread_s")
                        rec["exposed_pct"] = 100 * rec["exposed_s"] / local_med
                        cell.append(rec)
                    records += cell
                    verdicts[f"{gbit:g}/{n}"] = verdict(cell)
                    progress(f"{gbit:g} Gbit/s, {n} tokens: DP vs best uniform: {verdicts[f'{gbit:g}/{n}']}")
            control.close()
        finally:
            close_arena()
            rx.terminate()
            rx.wait(timeout=10)
    report(records, verdicts)
    payload = {"device": p.engine.device_name,
               "delay": delay or f"none: this kernel has no sch_netem ({no_delay}); the tbf rate alone",
               "bytes_per_token": bpt, "granule": GRANULE, "reps": args.reps, "costs": costs, "dp_plans": dp_plans,
               "verdicts": verdicts, "results": records, "command": _command()}
    write_json(args.out, payload)
    plot(records, RESULTS / f"{args.out}.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="256,1024,2048,4096")
    ap.add_argument("--links", default="1,10", help="Gbit/s, comma separated")
    ap.add_argument("--uniform", default="64,256,1024", help="uniform slice lengths")
    ap.add_argument("--reps", type=int, default=3, help="rounds per (link, prompt) cell, every mode once each")
    ap.add_argument("--cost-lengths", default="64,256,1024", help="slice lengths whose step time is measured")
    ap.add_argument("--cost-reps", type=int, default=2)
    ap.add_argument("--costs", help="a result name (--fit-only's --out) to take the cost model from")
    ap.add_argument("--fit-only", action="store_true", help="measure and fit the cost model, write it, stop")
    ap.add_argument("--out", default="cross_host")
    ap.add_argument("--transports", default="tcp", help="tcp, nixl (layers and uniform slices), shm (layers; one host)")
    ap.add_argument("--one-host", action="store_true", help="no namespaces: both ends on loopback, unshaped")
    ap.add_argument("--merge", help="comma-separated result names to join into --out (no measuring)")
    ap.add_argument("--receive", nargs=2, metavar=("HOST", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--selftest", nargs=2, metavar=("TX_NS", "RX_NS"), help=argparse.SUPPRESS)
    ap.add_argument("--in-netns", help=argparse.SUPPRESS)  # run_in_tx's child: the namespaces' names
    args = ap.parse_args()
    if args.receive:
        receive(args.receive[0], int(args.receive[1]))
        return
    if args.selftest:
        selftest(*args.selftest)
        return
    if args.merge:
        merge(args.merge.split(","), args.out)
        return
    if os.geteuid() != 0 and not args.fit_only and not args.one_host:
        raise SystemExit("cross_host needs root to make network namespaces and shape them with tc; "
                         "run it as root (e.g. sudo python -m bench.cross_host). Nothing was measured.")
    if "shm" in args.transports.split(",") and not args.one_host:
        raise SystemExit("the shm transport shares memory on one host: choose it with --one-host")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the namespaces' cleanup runs
    if not args.one_host and not args.fit_only and not args.in_netns:
        sys.exit(run_in_tx(sys.argv[1:]))  # the bench goes on as a process of the sending namespace
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # a core for the sender's thread and the receiver
    bench(args)


if __name__ == "__main__":
    main()
