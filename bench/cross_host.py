"""Prefill on one host, the KV imported on another: the exposed hand-off over a shaped link, per way of sending.

Two network namespaces made here (`hs-tx-<pid>`, `hs-rx-<pid>`) joined by a veth pair with addresses in
10.231.0.0/30; both ends get a tbf at R (1 and 10 Gbit/s) under netem's 0.5 ms delay; a kernel without
sch_netem (this machine's: CONFIG_NET_SCH_NETEM is not set) gets the tbf alone, and the JSON's `delay`
says so. A receiving process in `hs-rx` listens on 10.231.0.2 and imports each request's KV into host
memory the way decode does (a [layers, 2, kv_heads, n, dim] buffer, layer and token slice at a time,
services/kv/tcp.py). In `hs-tx` the torch engine (the real model, paged pool, `step`) prefills each
prompt and streams its KV:

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

Needs root (ip netns, tc); exits with a clear message otherwise. The namespaces are deleted on any exit.

    sudo python bench/cross_host.py --fit-only --sizes 4096 --out cross_host_costs   # the cost model
    sudo python bench/cross_host.py --costs cross_host_costs --sizes 1024 --links 1,10 --reps 3 --out cross_host_1024
    python bench/cross_host.py --merge cross_host_256,cross_host_1024,...   # one table, JSON and plot
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, progress, table, write_json  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TX_ADDR, RX_ADDR, PREFIX = "10.231.0.1", "10.231.0.2", 30
DELAY = "0.5ms"
TIMEOUT_S = 60.0
GRANULE = 64  # DP slice lengths are multiples of this (four 16-token blocks)


# ---- the two namespaces -------------------------------------------------------------------------
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Netns:
    """Two namespaces and a veth pair, `rate` (e.g. '1gbit', None: unshaped) and 0.5 ms each way.
    A context manager; deleted on exit, on SIGTERM and at interpreter exit, whatever happened."""

    def __init__(self, rate: str | None):
        pid = os.getpid()
        self.tx, self.rx = f"hs-tx-{pid}", f"hs-rx-{pid}"
        self.veth_tx, self.veth_rx = f"hst{pid % 100000}", f"hsr{pid % 100000}"
        self.rate = rate
        self.delay: str | None = None
        self.no_delay_reason: str | None = None

    @staticmethod
    def exec_in(ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def __enter__(self) -> "Netns":
        atexit.register(self.cleanup)
        try:
            _ip("netns", "add", self.tx)
            _ip("netns", "add", self.rx)
            _ip("link", "add", self.veth_tx, "type", "veth", "peer", "name", self.veth_rx)
            for ns, dev, addr in ((self.tx, self.veth_tx, TX_ADDR), (self.rx, self.veth_rx, RX_ADDR)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            self.shape(self.rate)
        except subprocess.CalledProcessError as exc:
            self.cleanup()
            raise RuntimeError(f"setting up the namespaces failed: {' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc
        except BaseException:
            self.cleanup()
            raise
        return self

    def shape(self, rate: str | None) -> None:
        """Both veth ends: netem's delay (when this kernel has netem) with a tbf at `rate` under it, or
        the tbf alone; replaces what was there. `self.delay` says what delay was really applied."""
        self.rate = rate
        for ns, dev in ((self.tx, self.veth_tx), (self.rx, self.veth_rx)):
            tc = [*self.exec_in(ns), "tc", "qdisc"]
            subprocess.run([*tc, "del", "dev", dev, "root"], capture_output=True)  # none there: fine
            netem = subprocess.run([*tc, "add", "dev", dev, "root", "handle", "1:", "netem", "delay", DELAY,
                                    "limit", "100000"], capture_output=True, text=True)
            self.delay = DELAY if netem.returncode == 0 else None
            self.no_delay_reason = None if self.delay else f"tc netem: {netem.stderr.strip() or netem.returncode}"
            if rate:
                bits = float(rate.removesuffix("gbit")) * 1e9
                burst = str(max(int(bits / 8 * 1e-3), 200_000))  # a millisecond of bytes: GSO packets fit
                where = ["parent", "1:1"] if self.delay else ["root"]
                subprocess.run([*tc, "add", "dev", dev, *where, "handle", "10:", "tbf", "rate", rate, "burst", burst,
                                "latency", "50ms"], capture_output=True, text=True, check=True)

    def cleanup(self) -> None:
        for ns in (self.tx, self.rx):  # deleting a namespace deletes its end of the veth, and so the pair
            _ip("netns", "del", ns, check=False)

    def __exit__(self, *exc) -> None:
        self.cleanup()
        atexit.unregister(self.cleanup)


# ---- the receiving host ---------------------------------------------------------------------------
class HostImporter:
    """Imports into host memory as decode would before its device copy: [layers, 2, kv_heads, n, dim]."""

    def __init__(self, layout):
        self.kv = np.empty(layout.shape, layout.dtype)

    def import_kv_layer(self, seq, layer, kv):
        self.kv[layer] = kv

    def import_kv_slice(self, seq, layer, start, kv):
        self.kv[layer, :, :, start:start + kv.shape[2]] = kv

    def finish_import(self, seq, n_tokens):
        pass


def receive(host: str, port: int) -> None:
    """Serve hand-offs until the control connection ends: per request, a JSON line {n_tokens, request,
    dtype} on the control connection, 'ready', one KV connection, then a JSON line with the outcome."""
    from services.kv.header import SlotHeader, request_nonce
    from services.kv.handoff import layout_of
    from services.kv.tcp import TcpListener, TcpReceiver
    from services.model.config import read_config
    from services.model.checkpoint import locate

    cfg = read_config(locate(None))
    with TcpListener(host, port + 1, timeout_s=TIMEOUT_S) as kv_listener, \
            socket.create_server((host, port)) as control_server:
        control_server.settimeout(TIMEOUT_S)
        print("listening", flush=True)
        control, _ = control_server.accept()
        control.settimeout(None)
        lines = control.makefile("rw")
        for line in lines:
            req = json.loads(line)
            expected = SlotHeader(req["dtype"], cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, req["n_tokens"],
                                  cfg.model_id, nonce=request_nonce(req["request"]))
            importer = HostImporter(layout_of(expected))
            importer.kv.fill(0)  # touch the pages now, as a decode engine's preallocated pool would be
            lines.write("ready\n")
            lines.flush()
            rx = TcpReceiver(kv_listener.accept(), importer, None, expected)
            try:
                rx.run()
                out = {"ok": True, "imported_at": rx.on_device_at, "bytes": rx.bytes,
                       "checksum": float(importer.kv[:, :, :, :: max(1, req["n_tokens"] // 7)].sum(dtype=np.float64))}
            except Exception as exc:  # reported to the sending side, which fails the bench
                out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            lines.write(json.dumps(out) + "\n")
            lines.flush()


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


def run_handoff(p: Prefiller, control, address, tokens, mode, slices=None) -> dict:
    """One prompt prefilled and sent as `mode` says; the receiver's outcome and the times."""
    from services.kv.handoff import PrefillDone
    from services.kv.header import SlotHeader, request_nonce
    from services.kv.tcp import TcpSender

    n, cfg = len(tokens), p.cfg
    request = f"bench-{mode}-{n}-{time.monotonic_ns()}"
    control.write(json.dumps({"n_tokens": n, "request": request, "dtype": "fp32"}) + "\n")
    control.flush()
    if control.readline().strip() != "ready":
        raise RuntimeError("the receiver did not get ready")
    header = SlotHeader("fp32", cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n, cfg.model_id,
                        nonce=request_nonce(request))
    L = cfg.n_layers
    with TcpSender(address, header, timeout_s=TIMEOUT_S) as tx:
        tx.open()
        t0 = time.time()
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
    out = json.loads(control.readline())
    if not out.get("ok"):
        raise RuntimeError(f"the receiver failed: {out.get('error')}")
    return {"mode": mode, "n_tokens": n, "slices": list(slices) if slices else None, "first_token": first,
            "start": t0, "compute_s": compute_end - t0, "imported_after_s": imported_at - t0,
            "tail_s": imported_at - compute_end, "bytes": out["bytes"], "checksum": out["checksum"]}


def run_local(p: Prefiller, tokens) -> dict:
    """The prompt prefilled in one step, nothing sent: the KV is where decode would be when it ends."""
    t0 = time.perf_counter()
    first = p.step(tokens, 0, len(tokens))
    p.sync()
    e2e = time.perf_counter() - t0
    return {"mode": "local", "n_tokens": len(tokens), "slices": None, "first_token": first, "compute_s": e2e,
            "imported_after_s": e2e, "tail_s": 0.0, "bytes": 0}


def load_or_fit_costs(args, p: Prefiller | None) -> dict:
    if args.costs:
        saved = json.loads((RESULTS / f"{args.costs}.json").read_text())
        return {**saved["costs"], "from": args.costs, "command": saved["command"]}
    lengths = [int(x) for x in args.cost_lengths.split(",")]
    grid = cost_grid(max(int(x) for x in args.sizes.split(",")), lengths)
    progress(f"measuring t(slice, context) on the engine at {len(grid)} points")
    return {**fit_costs(measure_costs(p, grid, args.cost_reps)), "command": _command()}


def _command() -> str:
    return "python bench/cross_host.py " + " ".join(sys.argv[1:])


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
    with Netns(rate=None) as ns:
        port = 47000 + os.getpid() % 1000
        rx = subprocess.Popen([*ns.exec_in(ns.rx), sys.executable, str(Path(__file__).resolve()), "--receive",
                               RX_ADDR, str(port)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            if rx.stdout.readline().strip() != "listening":
                raise RuntimeError("the receiving process did not start")
            # the sending side joins the tx namespace for its sockets only: setns on this thread
            _enter(ns.tx)
            control = socket.create_connection((RX_ADDR, port), timeout=TIMEOUT_S).makefile("rw")
            for gbit in links:
                ns.shape(f"{gbit:g}gbit")
                delay, no_delay = ns.delay, ns.no_delay_reason
                link = Link(gbit * 1e9 / 8 * 0.94, 0.5e-3 + 50e-6)  # TCP/IP overhead; delay plus per-send cost
                for n in sizes:
                    dp, dp_t = best_slices(n, model, link, bpt, granule=GRANULE, layers=L)
                    plans = [("local", None), ("whole", None), ("layers", None)]
                    plans += [(f"u{s}", uniform_slices(n, s)) for s in uniform if s < n]
                    plans.append(("dp", dp))
                    predicted = {"local": model(n, 0), "whole": pipeline_time([n], model, link, bpt, 1),
                                 "layers": pipeline_time([n], model, link, bpt, L),
                                 **{m: pipeline_time(sl, model, link, bpt, L) for m, sl in plans[3:]}}
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
                                r = run_handoff(p, control, (RX_ADDR, port + 1), prompts[n],
                                                mode if slices is None else "slices", slices)
                            runs[mode].append(r)
                        local_s = runs["local"][-1]["imported_after_s"]
                        for mode, _ in plans:
                            runs[mode][-1]["exposed_s"] = runs[mode][-1]["imported_after_s"] - local_s
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
                        for key in ("imported_after_s", "exposed_s", "compute_s", "tail_s"):
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
            rx.terminate()
            rx.wait(timeout=10)
    report(records, verdicts)
    payload = {"device": p.engine.device_name,
               "delay": delay or f"none: this kernel has no sch_netem ({no_delay}); the tbf rate alone",
               "bytes_per_token": bpt, "granule": GRANULE, "reps": args.reps, "costs": costs, "dp_plans": dp_plans,
               "verdicts": verdicts, "results": records, "command": _command()}
    write_json(args.out, payload)
    plot(records, RESULTS / f"{args.out}.png")


def verdict(cell: list[dict]) -> dict:
    """The DP against the uniform slicing with the lowest median exposed hand-off in one cell."""
    dp = next(r for r in cell if r["mode"] == "dp")
    uni = [r for r in cell if r["mode"].startswith("u")]
    if not uni:
        return {"best_uniform": None, "verdict": "no uniform slicing shorter than the prompt"}
    best = min(uni, key=lambda r: r["exposed_s"])
    diff = dp["exposed_s"] - best["exposed_s"]
    spread = max(dp["exposed_spread_s"], best["exposed_spread_s"])
    word = "yes" if diff <= 0 else "within spread" if diff <= spread else "no"
    same = [r["mode"] for r in uni if r["slices"] == dp["slices"]]  # then the difference is the noise floor
    return {"best_uniform": best["mode"], "dp_exposed_s": dp["exposed_s"], "uniform_exposed_s": best["exposed_s"],
            "difference_s": diff, "spread_s": spread, "verdict": word, "dp_plan_is": same[0] if same else None}


ROW_HEADERS = ["Gbit/s", "tokens", "mode", "slices", "predicted s", "e2e s", "exposed s", "spread s", "% prefill",
               "tail ms"]


def row_of(r: dict) -> list:
    return [f"{r['gbit']:g}", r["n_tokens"], r["mode"], len(r["slices"]) if r["slices"] else 1, r["predicted_s"],
            r["e2e_s"], r["exposed_s"], r["exposed_spread_s"], r["exposed_pct"], r["tail_s"] * 1e3]


def report(records: list[dict], verdicts: dict) -> None:
    records = sorted(records, key=lambda r: (r["gbit"], r["n_tokens"]))
    print(table(ROW_HEADERS, [row_of(r) for r in records]))
    print()
    print(table(["cell", "best uniform", "its exposed s", "dp exposed s", "dp - uniform s", "spread s", "DP <= uniform",
                 "DP plan is"],
                [[k, v["best_uniform"], v.get("uniform_exposed_s", ""), v.get("dp_exposed_s", ""),
                  v.get("difference_s", ""), v.get("spread_s", ""), v["verdict"], v.get("dp_plan_is") or "its own"]
                 for k, v in verdicts.items()]))


def merge(names: list[str], out: str) -> None:
    """Join the results of runs split by prompt size (and link) into one JSON, table and plot."""
    parts = [json.loads((RESULTS / f"{name}.json").read_text()) for name in names]
    models = {json.dumps(p["costs"]["model"], sort_keys=True) for p in parts}
    if len(models) != 1:
        raise SystemExit(f"the parts used {len(models)} different cost models; merge parts made with one --costs")
    commands = list(dict.fromkeys([parts[0]["costs"]["command"], *(p["command"] for p in parts)]))
    payload = {**parts[0], "results": [r for p in parts for r in p["results"]],
               "dp_plans": {k: v for p in parts for k, v in p["dp_plans"].items()},
               "verdicts": {f"{g:g}/{n}": verdict([r for r in (r for p in parts for r in p["results"])
                                                  if r["gbit"] == g and r["n_tokens"] == n])
                            for g, n in dict.fromkeys((r["gbit"], r["n_tokens"]) for p in parts for r in p["results"])},
               "reps": {name: p["reps"] for name, p in zip(names, parts)},
               "commands": commands + [f"python bench/cross_host.py --merge {','.join(names)} --out {out}"]}
    payload.pop("command", None)
    report(payload["results"], payload["verdicts"])
    write_json(out, payload)
    plot(payload["results"], RESULTS / f"{out}.png")


def plot(records, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gbits = sorted({r["gbit"] for r in records})
    # top: the exposed hand-off, median with the rounds' min..max; bottom: the tail after compute (log)
    fig, axes = plt.subplots(2, len(gbits), figsize=(6 * len(gbits), 7), squeeze=False)
    for col, g in enumerate(gbits):
        for row, key in enumerate(("exposed_s", "tail_s")):
            ax = axes[row][col]
            for mode in dict.fromkeys(r["mode"] for r in records if r["mode"] != "local"):
                rs = sorted((r for r in records if r["gbit"] == g and r["mode"] == mode), key=lambda r: r["n_tokens"])
                if not rs:
                    continue
                x = [r["n_tokens"] for r in rs]
                y = [r[key] * 1e3 for r in rs]
                if key == "exposed_s":
                    lo = [(r[key] - min(u[key] for u in r["runs"])) * 1e3 for r in rs]
                    hi = [(max(u[key] for u in r["runs"]) - r[key]) * 1e3 for r in rs]
                    ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=mode)
                else:
                    ax.plot(x, [max(v, 1e-2) for v in y], marker="o", label=mode)
            ax.set_xscale("log", base=2)
            if row == 0:
                ax.axhline(0, color="grey", lw=0.5)
                ax.set_title(f"{g:g} Gbit/s")
                ax.set_ylabel("exposed hand-off vs local prefill (ms)")
            else:
                ax.set_yscale("log")
                ax.set_ylabel("tail after compute (ms)")
            ax.set_xlabel("prompt tokens")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _enter(ns: str) -> None:
    """This thread into network namespace `ns`: sockets made from now on live there (made before: stay put)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # os.setns is Python 3.12+
    with open(f"/var/run/netns/{ns}") as f:
        if libc.setns(f.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")


def selftest(tx_ns: str, rx_ns: str) -> None:
    """For the tests: one hand-off of random bytes over the veth, the listener made in `rx_ns`, the sender's
    socket in `tx_ns` (both in this process: a socket stays in the namespace it was made in)."""
    import threading

    from services.kv.header import SlotHeader
    from services.kv.tcp import TcpListener, TcpReceiver, TcpSender
    from services.kv.handoff import layout_of

    header = SlotHeader("fp32", 4, 2, 8, 33, "selftest", nonce=7)
    kv = np.random.default_rng(0).normal(size=layout_of(header).shape).astype(np.float32)
    importer = HostImporter(layout_of(header))
    _enter(rx_ns)
    with TcpListener(RX_ADDR, 0, timeout_s=10) as listener:
        _enter(tx_ns)
        done = {}
        th = threading.Thread(target=lambda: done.update(r=TcpReceiver(listener.accept(), importer, None,
                                                                       header).run()))
        th.start()
        with TcpSender(listener.address, header, timeout_s=10) as tx:
            tx.open()
            for a in range(0, 33, 10):
                for layer in range(4):
                    tx.layer_buffer(layer)[:, :, a:a + 10] = kv[layer][:, :, a:a + 10]
                tx.send_slice(0, 4, a, min(a + 10, 33))
            tx.finish()
        th.join(10)
    if "r" not in done or not np.array_equal(importer.kv, kv):
        raise SystemExit("selftest failed: the KV did not arrive intact")
    print("selftest ok")


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
    ap.add_argument("--merge", help="comma-separated result names to join into --out (no measuring)")
    ap.add_argument("--receive", nargs=2, metavar=("HOST", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--selftest", nargs=2, metavar=("TX_NS", "RX_NS"), help=argparse.SUPPRESS)
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
    if os.geteuid() != 0 and not args.fit_only:
        raise SystemExit("cross_host needs root to make network namespaces and shape them with tc; "
                         "run it as root (e.g. sudo python bench/cross_host.py). Nothing was measured.")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the namespaces' cleanup runs
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # a core for the sender's thread and the receiver
    bench(args)


import numpy as np  # noqa: E402  (after the path set-up above)
import torch  # noqa: E402

if __name__ == "__main__":
    main()
