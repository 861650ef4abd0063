"""NIXL's pieces of a KV hand-off in isolation, two processes on this host: what UCX takes, how long one
layer's READ lasts, and what the side being read pays for making progress while its engine computes.

    reads      a target process registers a prompt's KV (the default model's shape, fp32: 30 layers of
               n × 1536 bytes) and a reader READs it one layer at a time (one descriptor) and by 256-token
               slices (one descriptor per k/v × kv head: 6 per layer), through `NixlAgent.read` as the
               transport does. Per UCX setting: `UCX_NET_DEVICES=lo` alone (UCX's own choice on one host)
               and `UCX_TLS=tcp` (what a host without RDMA uses across the network). Reported: the
               protocol UCX chose for host-memory READs (its UCX_PROTO_INFO table), the median READ in
               the first round (into a fresh buffer's unmapped pages, as a hand-off's) and in later ones
               (the same buffer again), and whether a READ completes while the target makes no progress.
    progress   the prefill itself (the real torch engine, one step of n tokens, one torch thread as the
               bench gives it) with the agent's progress loop resting, and running all along at its
               100 µs period (what the sender did before it progressed only while a READ was due),
               rounds interleaved A/B.

    python -m bench.micro.nixl_probe [--tokens 512,2000] [--progress-tokens 512] [--rounds 3]

Writes bench/results/cross_host_nixl_probe.json. Traffic stays on loopback.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from bench._common import ROOT, progress, table, write_json

SETTINGS = {"lo (UCX's choice)": {"UCX_NET_DEVICES": "lo"},
            "tcp only": {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}}
SLICE = 256


def model_shape() -> tuple[int, int, int]:
    from services.model.checkpoint import locate
    from services.model.config import read_config

    cfg = read_config(locate(None))
    return cfg.n_layers, cfg.n_kv_heads, cfg.head_dim


# ---- the two processes of `reads` ------------------------------------------------------------------
def target(port: int, nbytes: int) -> None:
    """Register `nbytes` of written memory, hand out its metadata, progress while told to."""
    from services.kv.nixl_agent import NixlAgent

    agent = NixlAgent("probe-target")
    buf = np.full(nbytes, 7, np.uint8)
    reg = agent.register(buf.ctypes.data, buf.nbytes)
    with socket.create_server(("127.0.0.1", port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        lines = conn.makefile("rw")
        lines.write(json.dumps({"addr": buf.ctypes.data, "meta": agent.metadata(reg).hex()}) + "\n")
        lines.flush()
        for line in lines:  # "on", "off", "quit"
            cmd = line.strip()
            if cmd == "on":
                agent.want_progress()
            elif cmd == "off":
                agent.drop_progress()
            if cmd == "quit":
                break
            lines.write("ok\n")
            lines.flush()
    agent.deregister(reg)
    agent.close()


def reader(port: int, tokens: list[int], rounds: int) -> dict:
    """Per prompt length: READ times per layer (whole, sliced), first round and later rounds."""
    from services.kv.nixl_agent import NixlAgent, TransferFailed

    n_layers, kv_heads, dim = model_shape()
    row = dim * 4
    agent = NixlAgent("probe-reader")
    lines = socket.create_connection(("127.0.0.1", port), timeout=30).makefile("rw")
    offer = json.loads(lines.readline())

    def tell(cmd):
        lines.write(cmd + "\n")
        lines.flush()
        return lines.readline()

    tell("on")  # the connection's wire-up needs the target's progress
    t0 = time.perf_counter()
    remote = agent.add_remote(bytes.fromhex(offer["meta"]))
    first = np.empty(64, np.uint8)
    reg = agent.register(first.ctypes.data, first.nbytes)
    agent.read(remote, [(first.ctypes.data, offer["addr"], 64)], 10)
    out = {"connect_and_first_read_ms": (time.perf_counter() - t0) * 1e3, "prompts": {}}
    agent.deregister(reg)
    base = offer["addr"]
    for n in tokens:
        layer = 2 * kv_heads * n * row
        cell = {"layer_bytes": layer}
        for kind in ("layer", f"slice{SLICE}"):
            rounds_ms = []
            dst = np.empty(n_layers * layer, np.uint8)  # fresh pages in round 1, as a hand-off's own buffer
            reg = agent.register(dst.ctypes.data, dst.nbytes)
            for _ in range(rounds):  # later rounds: the same buffer, its pages mapped already
                ts = []
                for lay in range(n_layers):
                    at = lay * layer
                    if kind == "layer":
                        pairs = [(dst.ctypes.data + at, base + at, layer)]
                    else:  # the first slice of the layer: one run per (k|v, head) of SLICE rows
                        pairs = [(dst.ctypes.data + at + j * n * row, base + at + j * n * row, SLICE * row)
                                 for j in range(2 * kv_heads)]
                    t = time.perf_counter()
                    agent.read(remote, pairs, 10)
                    ts.append(time.perf_counter() - t)
                if kind == "layer" and dst[::4096].min() != 7:
                    raise SystemExit("the READ did not bring the target's bytes")
                rounds_ms.append([t * 1e3 for t in ts])
            agent.deregister(reg)
            later = [t for r in rounds_ms[1:] for t in r]
            nbytes = layer if kind == "layer" else 2 * kv_heads * SLICE * row
            cell[kind] = {"bytes": nbytes, "fresh_pages_median_ms": statistics.median(rounds_ms[0]),
                          "fresh_pages_sum_ms": sum(rounds_ms[0]), "median_ms": statistics.median(later),
                          "max_ms": max(later), "gb_s": nbytes / statistics.median(later) / 1e6}
        out["prompts"][str(n)] = cell
    # a READ while the target does not progress at all (after the wire-up)
    tell("off")
    dst = np.empty(2 * kv_heads * tokens[-1] * row, np.uint8)
    reg = agent.register(dst.ctypes.data, dst.nbytes)
    t = time.perf_counter()
    try:
        agent.read(remote, [(dst.ctypes.data, base, dst.nbytes)], 3.0)
        out["read_without_target_progress"] = f"completes ({(time.perf_counter() - t) * 1e3:.1f} ms)"
    except TransferFailed:
        out["read_without_target_progress"] = "does not complete within 3 s"
    agent.deregister(reg)
    tell("quit")
    agent.release_remote(remote)
    agent.close()
    return out


def chosen_protocol(log: str) -> str:
    """The rows UCX_PROTO_INFO lists under 'remote memory read ... into host memory' (the last such table:
    the endpoint to the other process, not the agent's own): "range: how, transport/device" each."""
    lines = log.splitlines()
    heads = [i for i, line in enumerate(lines) if "remote memory read" in line and "host memory" in line]
    if not heads:
        return "not reported"
    rows = []
    for line in lines[heads[-1] + 4:]:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) != 3:
            break
        rows.append(f"{cells[0]}: {cells[1]}, {cells[2]}")
    return "; ".join(rows) or "not reported"


def run_reads(tokens: list[int], rounds: int) -> dict:
    n_layers, kv_heads, dim = model_shape()
    nbytes = n_layers * 2 * kv_heads * max(tokens) * dim * 4
    results = {}
    for name, env in SETTINGS.items():
        port = 46000 + os.getpid() % 1000
        penv = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
        tgt = subprocess.Popen([sys.executable, "-m", "bench.micro.nixl_probe", "--target", str(port), str(nbytes)],
                               cwd=ROOT, env=penv, stdout=subprocess.PIPE, text=True)
        try:
            if tgt.stdout.readline().strip() != "listening":
                raise SystemExit("the target process did not start")
            rd = subprocess.run([sys.executable, "-m", "bench.micro.nixl_probe", "--reader", str(port),
                                 ",".join(map(str, tokens)), str(rounds)], cwd=ROOT, capture_output=True, text=True,
                                env={**penv, "UCX_PROTO_INFO": "y"}, timeout=600)
            if rd.returncode:
                raise SystemExit(f"the reader failed: {rd.stderr[-2000:]}")
            res = json.loads(rd.stdout.strip().splitlines()[-1])
            res["ucx_env"] = env
            res["protocol"] = chosen_protocol(rd.stdout + rd.stderr)
            results[name] = res
            progress(f"{name}: {res['protocol']}, READ without target progress: {res['read_without_target_progress']}")
        finally:
            tgt.wait(timeout=30) if tgt.poll() is None else None
    return results


def run_progress(n: int, rounds: int) -> dict:
    """One step of n tokens with the agent resting, and with its progress loop on all along."""
    import torch

    from bench.cross_host import Prefiller
    from services.kv.nixl_agent import NixlAgent

    torch.set_num_threads(1)
    p = Prefiller(n, n + 64)
    tokens = np.random.default_rng(1).integers(3, p.cfg.vocab_size, n).tolist()
    p.step(tokens, 0, 64)  # warm-up
    agent = NixlAgent("probe-progress")
    times = {"resting": [], "progress all along": []}
    cpu = {k: [] for k in times}  # the process's CPU seconds (every thread): what the loop costs, whatever the load
    for r in range(rounds):
        for name in (list(times) if r % 2 == 0 else list(times)[::-1]):
            if name == "resting":
                t, c = time.perf_counter(), time.process_time()
                p.step(tokens, 0, n)
            else:
                before = agent.progress_calls
                with agent.serving():
                    t, c = time.perf_counter(), time.process_time()
                    p.step(tokens, 0, n)
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
        progress(f"prefill of {n}: " + ", ".join(f"{k} {v[-1]:.3f} s ({cpu[k][-1]:.3f} s CPU)" for k, v in times.items()))
    calls_per_s = (agent.progress_calls - before) / times["progress all along"][-1]
    agent.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {"n_tokens": n, "runs_s": times, "cpu_s": cpu, "median_s": med, "median_cpu_s": med_cpu,
            "ratio": med["progress all along"] / med["resting"],
            "cpu_ratio": med_cpu["progress all along"] / med_cpu["resting"], "progress_calls_per_s": calls_per_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="512,2000")
    ap.add_argument("--progress-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="cross_host_nixl_probe")
    ap.add_argument("--target", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--reader", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.target:
        target(*args.target)
        return
    if args.reader:
        port, tokens, rounds = args.reader
        print(json.dumps(reader(int(port), [int(x) for x in tokens.split(",")], int(rounds))))
        return
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    tokens = [int(x) for x in args.tokens.split(",")]
    load = os.getloadavg()
    reads = run_reads(tokens, args.rounds)
    prog = run_progress(args.progress_tokens, args.rounds * 2) if args.progress_tokens else None
    rows = [[name, n, kind, r["protocol"], round(c[kind]["bytes"] / 1e6, 2), round(c[kind]["fresh_pages_median_ms"], 2),
             round(c[kind]["median_ms"], 3), round(c[kind]["gb_s"], 2)]
            for name, r in reads.items() for n, c in r["prompts"].items() for kind in ("layer", f"slice{SLICE}")]
    print(table(["UCX", "tokens", "READ of", "protocol", "MB", "fresh pages ms", "warm ms", "GB/s"], rows))
    if prog:
        print(f"prefill of {prog['n_tokens']} tokens: resting {prog['median_s']['resting']:.3f} s, progress loop on "
              f"{prog['median_s']['progress all along']:.3f} s ({prog['ratio']:.2f}x; CPU {prog['cpu_ratio']:.2f}x; "
              f"{prog['progress_calls_per_s']:.0f} progress calls/s)")
    write_json(args.out, {"reads": reads, "progress": prog, "loadavg_before": load, "loadavg_after": os.getloadavg(),
                          "command": "python -m bench.micro.nixl_probe " + " ".join(sys.argv[1:])})


if __name__ == "__main__":
    main()
