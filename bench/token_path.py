"""Per-token path: each hop from the engine loop's step to the client's SSE chunk, at one client.

Starts the stack with HYBRIDSERVE_TOKEN_TRACE (services/token_trace.py: every process keeps each
token's hop times, perf_counter = CLOCK_MONOTONIC, one clock for the host), streams greedy
completions from one client per mode in turn (the client timestamps each SSE chunk on the same
clock), then joins the records by request id and token count:

    step      the engine loop's step that made the token (its own duration)
    period    the loop's step end to its next step end (one token's cost in the loop)
    got       step end -> the gRPC thread has the event (a thread hop)
    sent      -> its message built and handed to gRPC
    recv      -> the gateway has read it from the call (gRPC, loopback, the gateway's event loop)
    detok     -> detokenized, stop strings applied
    sse       -> the SSE chunk built (JSON), handed to the HTTP server
    client    -> the client has the chunk (HTTP, loopback, the client's parse)
    server ITL  the gaps between the server's last hop of each chunk (sse; `sent` for an engine alone):
              the ITL before the client's own scheduling (a client on a loaded machine reads in bursts)
    ITL       the client's gaps between chunks; the target: ITL p50 <= 1.15 x the engine's step p50

and, in turn with each mode, the same requests sent to its engine's Generate straight over gRPC
(`<mode> engine alone`: no gateway, no HTTP client), for the step with nothing else on the CPU.

Prints a table of per-hop medians per mode and writes bench/results/token_path.json.

    python -m bench.token_path [--modes fpga,gpu] [--requests 6] [--tokens 128] [--rounds 2] [--name token_path]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench._common import RESULTS, progress, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.serving.client import served_model  # noqa: E402
from bench.serving.report import command_line  # noqa: E402
from bench.serving.servers import Servers  # noqa: E402
from bench.serving.workload import Salter, corpus_ids, workload  # noqa: E402

HOPS = ("got", "sent", "recv", "detok", "sse", "client")  # in order, each after the one before
PREV = {"got": "step_end", "sent": "got", "recv": "sent", "detok": "recv", "sse": "detok", "client": "sse"}


async def stream_one(client: httpx.AsyncClient, url: str, mode: str, prompt: list[int], n_out: int,
                     model: str) -> dict:
    """One streamed completion: its id and each text chunk's receipt time."""
    body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True, "stream": True,
            "mode": mode}
    rid, times = None, []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"in stream: {chunk['error']}")
            rid = rid or chunk.get("id")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(now)
    return {"rid": rid, "client": times, "after": "sse"}


def direct_client(address: str, mode: str, reqs: list, salt: Salter, tag: str) -> list[dict]:
    """The engine's Generate called straight over gRPC (no gateway, no HTTP): the step without them."""
    import grpc

    from services.modes import MODES
    from services.rpc.hybridserve.v1 import engine_pb2 as pb
    from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc

    runs = []
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.EngineStub(ch)
        for i, (prompt, n_out) in enumerate(reqs):
            rid, times = f"{tag}-{i}", []
            sampling = pb.SamplingParams(max_tokens=n_out, ignore_eos=True)
            for _ in stub.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=salt(prompt),
                                                      sampling=sampling, mode=MODES[mode].proto), timeout=600):
                times.append(time.perf_counter())
            runs.append({"rid": rid, "client": times, "after": "sent"})
    return runs


async def one_client(url: str, mode: str, reqs: list, salt: Salter) -> list[dict]:
    model = served_model(url)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), trust_env=False) as client:
        return [await stream_one(client, url, mode, salt(prompt), n_out, model) for prompt, n_out in reqs]


def read_traces(folder: Path) -> tuple[dict, list]:
    """rid -> hop -> {n: t} (every process's records), and every engine step (start, end, rows)."""
    hops: dict = {}
    steps: list = []
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "step" in rec:
                steps.append(tuple(rec["step"]))
            else:
                hops.setdefault(rec["rid"], {}).setdefault(rec["hop"], {})[rec["n"]] = rec["t"]
    return hops, steps


def analyse(runs: list[dict], hops: dict, steps: list) -> dict:
    """Per-hop latencies (ms) of every token after the first, the steps, the loop's period, the ITL."""
    step_of_end = {round(e, 9): e - s for s, e, _ in steps}
    per_hop: dict[str, list[float]] = {h: [] for h in HOPS}
    step_ms, period_ms, itl_ms, tokens_per_msg, server_gaps = [], [], [], [], []
    for run in runs:
        h = hops.get(run["rid"], {})
        if not h:
            raise SystemExit(f"no trace records for request {run['rid']}: was HYBRIDSERVE_TOKEN_TRACE read?")
        # the k-th chunk (message) the client got is the k-th sse (sent) of the request
        h["client"] = dict(zip(sorted(h.get(run["after"], {})), run["client"]))
        ends = h.get("step_end", {})
        for n in sorted(ends):
            if n == 1:
                continue  # the first token's step is the prefill's
            if round(ends[n], 9) in step_of_end:
                step_ms.append(step_of_end[round(ends[n], 9)] * 1e3)
            if n - 1 in ends:
                period_ms.append((ends[n] - ends[n - 1]) * 1e3)
        for hop in HOPS:
            before = h.get(run["after"] if hop == "client" else PREV[hop], {})
            for n, t in h.get(hop, {}).items():
                # a message carries tokens up to n: the hop's start is that of its last token
                if n > 1 and n in before:
                    per_hop[hop].append((t - before[n]) * 1e3)
        last = [h[run["after"]][n] for n in sorted(h.get(run["after"], {}))]  # the server's last hop, per chunk
        server_gaps += [(b - a) * 1e3 for a, b in zip(last, last[1:])]
        sent = sorted(h.get("sent", {}))
        tokens_per_msg += [b - a for a, b in zip([0] + sent, sent)]
        itl_ms += [(b - a) * 1e3 for a, b in zip(run["client"], run["client"][1:])]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    p99 = lambda xs: sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else None  # noqa: E731
    out = {"step_ms_p50": med(step_ms), "period_ms_p50": med(period_ms), "itl_ms_p50": med(itl_ms),
           "itl_ms_p99": p99(itl_ms), "server_itl_ms_p50": med(server_gaps), "hop_ms_p50": {k: med(v) for k, v in per_hop.items()},
           "step_end_to_client_ms_p50": None, "tokens": len(itl_ms) + len(runs),
           "messages_with_several_tokens": sum(1 for k in tokens_per_msg if k > 1),
           "messages": len(tokens_per_msg)}
    if all(out["hop_ms_p50"][k] is not None for k in HOPS) and runs[0]["after"] == "sse":
        out["step_end_to_client_ms_p50"] = sum(out["hop_ms_p50"].values())
    if out["step_ms_p50"] and out["itl_ms_p50"]:
        out["itl_over_step"] = out["itl_ms_p50"] / out["step_ms_p50"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="fpga,gpu")
    ap.add_argument("--requests", type=int, default=6, help="per mode")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (each mode, its engine alone)")
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument("--name", default="token_path")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    corpus, _ = corpus_ids()
    reqs = workload(corpus, args.requests, args.seed, (args.prompt, args.prompt), (args.tokens, args.tokens))
    salt = Salter(args.seed)
    servers = Servers()
    runs: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="token-trace-") as trace:
        try:
            url = servers.start_stack(out / f"{args.name}_stack.log", extra_env={"HYBRIDSERVE_TOKEN_TRACE": trace})
            stack = servers.started[-1]
            for mode in modes:  # warm every mode's path once
                asyncio.run(one_client(url, mode, reqs[:1], salt))
            for r in range(args.rounds):  # through the gateway and straight to the engine, in turn
                for mode in modes:
                    progress(f"round {r + 1}: {mode}: {args.requests} requests of {args.tokens} tokens, one client")
                    runs.setdefault(mode, []).extend(asyncio.run(one_client(url, mode, reqs, salt)))
                    if mode in ("gpu", "fpga"):
                        address = stack.prefill_address if mode == "gpu" else stack.decode_address
                        runs.setdefault(f"{mode} engine alone", []).extend(
                            direct_client(address, mode, reqs, salt, f"direct-{mode}-{r}"))
        finally:
            servers.stop()
        hops, steps = read_traces(Path(trace))
    results = {mode: analyse(rs, hops, steps) for mode, rs in runs.items()}
    rows = []
    for mode, r in results.items():
        f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        rows.append([mode, f(r["step_ms_p50"]), f(r["period_ms_p50"]), *(f(r["hop_ms_p50"][k]) for k in HOPS),
                     f(r["step_end_to_client_ms_p50"]), f(r["server_itl_ms_p50"]), f(r["itl_ms_p50"]),
                     f(r["itl_ms_p99"]),
                     f(r.get("itl_over_step")), f"{r['messages_with_several_tokens']}/{r['messages']}"])
    print(table(["mode", "step", "period", *HOPS, "step end->client", "server ITL", "ITL p50", "ITL p99", "ITL/step",
                 "multi-token msgs"], rows))
    print("medians in ms, one client, tokens after the first; hops are step end -> got -> sent -> recv -> detok "
          "-> sse -> client; `engine alone`: its Generate over gRPC with no gateway (client = the gRPC reader)")
    write_json(args.name, {"command": command_line(), "requests_per_mode": args.requests,
                           "output_tokens": args.tokens, "prompt_tokens": args.prompt,
                           "loadavg_1m_after": os.getloadavg()[0], "results": results},
               out_dir=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
