"""Serving benchmark: closed-loop streaming clients against OpenAI-compatible servers, interleaved.

At each concurrency level (default 1, 2, 4, 8, 16, 32) `c` clients each send their next request
as soon as the previous one has finished, until the level's fixed-seed list of requests is done:
prompts of 32-512 token ids cut from real text tokenized with the served model's tokenizer, outputs
of 64-256 tokens with `ignore_eos` and `temperature: 0`, streamed from `/v1/completions`. Every
target gets the same token ids, so the work is identical: our stack once per mode (`gpu`, `fpga`,
`hybrid`, `auto` through the `mode` body field) and any other server given with `--target`
(llama.cpp's `llama-server` and vLLM both take token-id arrays as `prompt`). Targets take turns
within each round (the order rotates round by round) and every figure is the median over rounds,
so drift on a noisy, shared machine falls on all targets alike.

Per (target, concurrency): output tokens/s and requests/s (over the wall time of the level),
TTFT, ITL (gaps between streamed text chunks) and end-to-end p50/p99, errors and the first
messages. At the highest concurrency it also samples each process's RSS and the engines' KV and
queue gauges from their Prometheus endpoints (whatever exists; absence is tolerated). It prints a
table, writes `serve.json` (with the exact command line) and `serve_throughput.png`,
`serve_latency.png` (tokens/s, TTFT p50 and ITL p99 against concurrency, one line per target).

Why a small asyncio + httpx client and not an established load generator: guidellm and locust
are not installed here, and neither does what this measurement needs without as much code again.
locust is a generic HTTP load tool: streaming TTFT/ITL would be our own code inside its tasks.
guidellm benchmarks one server per invocation, with prompts it generates as text; we need the same
token ids sent to every target (our gateway and llama-server would each re-tokenize text), targets
interleaved at each concurrency level inside one run, and the servers' RSS and KV gauges sampled
while the load is on. Both would add a large dependency tree for a loop of ~60 lines.

    python bench/serve.py --start-stack [--llama-server PATH] [--quick] [--rounds 3]
    python bench/serve.py --url http://127.0.0.1:8000 --target llama-server=http://127.0.0.1:8080
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from _common import ROOT, RESULTS, progress, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import numpy as np  # noqa: E402

MODES = ("gpu", "fpga", "hybrid", "auto")
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
CORPUS_FILES = ("README.md", "docs/architecture.md", "bench/README.md")  # real text, shipped with the repo
# concurrency levels, prompt and output token ranges, requests per run (a function of c), rounds
PRESETS = {
    "default": ((1, 2, 4, 8, 16, 32), (32, 512), (64, 256), lambda c: max(8, 2 * c), 3),
    "quick": ((1, 2), (32, 256), (16, 48), lambda c: 2 * c, 2),
}
# gauges and counters worth reading from an engine's /metrics (ours and llama-server's names)
ENGINE_GAUGE_WORDS = ("kv_cache", "kv_arena", "num_requests", "preempt", "queue_depth", "requests_processing",
                      "requests_deferred")


@dataclass
class Target:
    """One server under test: where it is and what it adds to every request body (our `mode`)."""

    name: str
    url: str
    extra: dict = field(default_factory=dict)
    model: str = "default"


def loopback_url(url: str) -> str:
    if urlparse(url).hostname not in LOOPBACK:
        raise SystemExit(f"{url}: only loopback addresses are benchmarked")
    return url.rstrip("/")


# ---------------------------------------------------------------- workload

def corpus_ids() -> tuple[list[int], str]:
    """The repo's own prose tokenized once with the served model's tokenizer; its sha256 for the record."""
    from services.model.checkpoint import locate
    from services.model.tokenizer import load_tokenizer
    from services.settings import CommonSettings

    tok = load_tokenizer(locate(CommonSettings().model))
    text = "\n\n".join((ROOT / f).read_text() for f in CORPUS_FILES if (ROOT / f).is_file())
    ids = tok(text, add_special_tokens=False).input_ids
    return ids, hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest()[:16]


def workload(corpus: list[int], n: int, seed: int, prompt_range, output_range) -> list[tuple[list[int], int]]:
    """n requests (prompt ids, output tokens): windows of the corpus at seeded offsets and lengths."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        n_in = rng.randint(*prompt_range)
        if n_in > len(corpus):
            raise SystemExit(f"the corpus has {len(corpus)} tokens, fewer than a {n_in}-token prompt")
        start = rng.randrange(len(corpus) - n_in + 1)
        reqs.append((corpus[start:start + n_in], rng.randint(*output_range)))
    return reqs


# ---------------------------------------------------------------- client

async def one_request(client: httpx.AsyncClient, target: Target, prompt: list[int], n_out: int) -> dict:
    """A streamed completion: wall-clock TTFT, gaps between text chunks, e2e, tokens, or the error."""
    body = {"model": target.model, "prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **target.extra}
    t0 = time.perf_counter()
    first = last = None
    gaps, chunks, usage = [], 0, None
    try:
        async with client.stream("POST", target.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return {"error": f"in stream: {json.dumps(chunk['error'])[:200]}"}
                usage = chunk.get("usage") or usage
                # only chunks carrying text time tokens: the closing chunk follows the last token at once
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    chunks += 1
                    if first is None:
                        first = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    tokens = (usage or {}).get("completion_tokens") or chunks
    if first is None:
        return {"error": "the stream carried no text"}
    return {"error": None, "ttft": first, "itl": gaps, "e2e": time.perf_counter() - t0, "tokens": tokens,
            "short": tokens < n_out}


async def closed_loop(target: Target, reqs: list, concurrency: int) -> tuple[list[dict], float]:
    """`concurrency` clients draining `reqs` in order, each sending its next request when one ends."""
    queue = list(reversed(reqs))
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10), limits=limits, trust_env=False) as client:
        async def worker() -> None:
            while queue:
                prompt, n_out = queue.pop()
                results.append(await one_request(client, target, prompt, n_out))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    itl = [g for r in ok for g in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    out = {"output_tok_s": tokens / wall, "req_s": len(ok) / wall, "wall_s": wall, "tokens": tokens,
           "requests": len(ok), "errors": len(results) - len(ok), "short_outputs": sum(r["short"] for r in ok),
           "error_messages": first_distinct(r["error"] for r in results if r["error"])}
    # time per output token after the first: unlike ITL, it does not depend on how tokens are chunked
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    for key, xs in (("ttft", [r["ttft"] for r in ok]), ("itl", itl), ("tpot", tpot), ("e2e", [r["e2e"] for r in ok])):
        out[f"{key}_p50"], out[f"{key}_p99"] = pct(xs, 50), pct(xs, 99)
    return out


TOTALS = ("tokens", "requests", "errors", "short_outputs")


def over_rounds(rounds: list[dict]) -> dict:
    """One (target, level): the median of each figure over rounds, the totals, the first error messages."""
    med = {}
    for key, v in rounds[0].items():
        if key not in TOTALS and (isinstance(v, (int, float)) or v is None):
            xs = [r[key] for r in rounds if r[key] is not None]
            med[key] = statistics.median(xs) if xs else None
    return {"median": med, "totals": {k: sum(r[k] for r in rounds) for k in TOTALS},
            "error_messages": first_distinct(m for r in rounds for m in r["error_messages"]), "rounds": rounds}


def first_distinct(messages, n: int = 3) -> list[str]:
    return list(dict.fromkeys(messages))[:n]


# ---------------------------------------------------------------- memory and engine gauges

class Sampler:
    """While the load is on: peak RSS of named processes and peak engine gauges, every 0.5 s, in a thread."""

    def __init__(self, pids: dict[str, int], metrics: dict[str, str]):
        self.pids, self.metrics = pids, metrics
        self.rss_mb: dict[str, float] = {}
        self.gauges: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        import psutil
        from prometheus_client.parser import text_string_to_metric_families

        while True:
            for name, pid in self.pids.items():
                try:
                    mb = psutil.Process(pid).memory_info().rss / 2**20
                    self.rss_mb[name] = max(mb, self.rss_mb.get(name, 0.0))
                except psutil.Error:
                    pass
            for source, url in self.metrics.items():
                try:
                    text = httpx.get(url, timeout=2, trust_env=False).text
                    for fam in text_string_to_metric_families(text):
                        if fam.type in ("gauge", "counter") and any(w in fam.name for w in ENGINE_GAUGE_WORDS):
                            for s in fam.samples:
                                g = self.gauges.setdefault(source, {})
                                g[s.name] = max(s.value, g.get(s.name, float("-inf")))
                except (httpx.HTTPError, ValueError):
                    pass  # an engine without a metrics endpoint, or one that is busy: tolerate it
            if self._stop.wait(0.5):
                return


def stack_children(pid: int) -> dict[str, int]:
    """The engine and gateway processes under `hybridserve up`, by service name."""
    import psutil

    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        cmd = " ".join(child.cmdline())
        for name in ("prefill_gpu", "decode_fpga", "gateway"):
            if f"services.{name}" in cmd:
                found[name] = child.pid
    return found


# ---------------------------------------------------------------- servers

def start_llama_server(binary: str, gguf: Path, slots: int, ctx_per_slot: int, threads: int, log: Path):
    """llama.cpp's server on a free loopback port, one slot per client, continuous batching."""
    from _stack import _free_port

    port = _free_port()
    cmd = [binary, "-m", str(gguf), "-np", str(slots), "-cb", "-t", str(threads), "--host", "127.0.0.1",
           "--port", str(port), "-c", str(slots * ctx_per_slot), "--metrics"]
    progress(f"starting {shlex.join(cmd)} (log: {log})")
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_process(proc)
    raise TimeoutError(f"llama-server did not come up; see {log}")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def served_model(url: str) -> str:
    try:
        return httpx.get(url + "/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return "default"


def warm_up(target: Target, prompt: list[int], timeout: float = 300) -> None:
    """One small request, retried while the server is still coming up (HTTP 503 or refused)."""
    deadline = time.monotonic() + timeout
    while True:
        r = asyncio.run(closed_loop(target, [(prompt, 4)], 1))[0][0]
        if r["error"] is None:
            return
        if time.monotonic() > deadline or not ("503" in r["error"] or "Connect" in r["error"]):
            raise SystemExit(f"{target.name}: warm-up failed: {r['error']}")
        progress(f"{target.name}: {r['error']}; retrying")
        time.sleep(2)


# ---------------------------------------------------------------- output

def plots(out: Path, results: dict, levels: tuple[int, ...]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    def line(ax, key: str, scale: float = 1.0) -> None:
        for name, per_c in results.items():
            ys = [per_c[c]["median"][key] for c in levels]
            ax.plot(levels, [y * scale if y is not None else np.nan for y in ys], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.grid(alpha=0.3)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    line(ax, "output_tok_s")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("output tokens/s (median over rounds)")
    ax.set_title("Throughput against concurrency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "serve_throughput.png"]
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in zip(axes, ("ttft_p50", "itl_p99"), ("TTFT p50", "ITL p99")):
        line(ax, key, 1e3)
        ax.set_ylabel("ms (median over rounds)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"{title} against concurrency")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "serve_latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def print_table(results: dict, ratios: dict, baseline: str | None) -> None:
    headers = ["target", "c", "tok/s", "req/s", "TTFT p50 ms", "p99", "ITL p50 ms", "p99", "E2E p50 s", "p99",
               "errors"] + ([f"x {baseline}"] if baseline else [])
    rows = []
    for name, per_c in results.items():
        for c, v in per_c.items():
            m = v["median"]
            rows.append([name, c, f"{m['output_tok_s']:.1f}", f"{m['req_s']:.2f}", ms(m["ttft_p50"]),
                         ms(m["ttft_p99"]), ms(m["itl_p50"]), ms(m["itl_p99"]),
                         "-" if m["e2e_p50"] is None else f"{m['e2e_p50']:.2f}",
                         "-" if m["e2e_p99"] is None else f"{m['e2e_p99']:.2f}", v["totals"]["errors"]]
                        + ([f"{ratios[name][c]:.2f}" if ratios.get(name, {}).get(c) else "-"] if baseline else []))
    print(table(headers, rows))


# ---------------------------------------------------------------- main

def parse_pairs(items: list[str], what: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"{what} must be NAME=VALUE, got {item!r}")
        pairs[name] = value
    return pairs


def build_args() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="concurrency 1,2, short outputs, few requests (a test)")
    ours = ap.add_mutually_exclusive_group()
    ours.add_argument("--start-stack", action="store_true", help="start our stack on free ports, stop it after")
    ours.add_argument("--url", help="our running gateway (its modes become targets)")
    ap.add_argument("--modes", default=",".join(MODES), help="our modes to measure (comma-separated)")
    ap.add_argument("--target", action="append", default=[], help="NAME=URL of another OpenAI-compatible server")
    ap.add_argument("--llama-server", metavar="PATH", help="start this llama-server binary on the same GGUF")
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--pid", action="append", default=[], help="NAME=PID whose RSS to record")
    ap.add_argument("--metrics", action="append", default=[], help="NAME=URL of a Prometheus endpoint to sample")
    ap.add_argument("--baseline", help="target the tokens/s ratio is taken against (default: the first external)")
    ap.add_argument("--concurrency", help="comma-separated levels (overrides the preset)")
    ap.add_argument("--requests", type=int, help="requests per level and round (default: max(8, 2c))")
    ap.add_argument("--prompt-range", help="MIN,MAX prompt tokens")
    ap.add_argument("--output-range", help="MIN,MAX output tokens")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--out", default=str(RESULTS))
    return ap


@dataclass
class Servers:
    """What this run started (stopped at the end) and what it measures: targets, PIDs, metrics endpoints."""

    targets: list[Target] = field(default_factory=list)
    externals: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)
    started: list = field(default_factory=list)  # objects with .stop(), or Popen

    def stop(self) -> None:
        for thing in reversed(self.started):
            thing.stop() if hasattr(thing, "stop") else stop_process(thing)


def bring_up(args, servers: Servers, out: Path, max_clients: int, ctx_per_slot: int) -> None:
    ours_url = args.url and loopback_url(args.url)
    if args.start_stack:
        from _stack import start_stack

        stack = start_stack(out / "serve_stack.log")
        servers.started.append(stack)
        ours_url = stack.url
        servers.pids.update(stack_children(stack.process.proc.pid))
        for name, port in (("prefill_gpu", "prefill_metrics"), ("decode_fpga", "decode_metrics")):
            servers.metrics.setdefault(name, f"http://127.0.0.1:{stack.ports[port]}/metrics")
    if args.llama_server:
        from services.model.checkpoint import locate
        from services.settings import CommonSettings

        proc, url = start_llama_server(args.llama_server, locate(CommonSettings().model).path, max_clients,
                                       ctx_per_slot, args.llama_threads, out / "serve_llama_server.log")
        servers.started.append(proc)
        servers.externals["llama-server"] = url
        servers.pids["llama-server"] = proc.pid
        servers.metrics.setdefault("llama-server", url + "/metrics")
    if ours_url:
        model = served_model(ours_url)
        servers.targets += [Target(f"hybridserve-{m}", ours_url, {"mode": m}, model) for m in args.modes.split(",")]
    servers.targets += [Target(n, u, {}, served_model(u)) for n, u in servers.externals.items()]


def run_levels(servers: Servers, work: dict, rounds: int) -> tuple[dict, dict]:
    """Every level, every round, every target in turn; the sampler runs at the highest level only."""
    targets, top = servers.targets, max(work)
    runs = {t.name: {c: [] for c in work} for t in targets}
    memory = {"concurrency": top, "rss_mb": {}, "engine_gauges": {}}
    for c, reqs in work.items():
        for r in range(rounds):
            k = r % len(targets)  # rotate the order, so no target always runs first
            for t in targets[k:] + targets[:k]:
                progress(f"c={c} round {r + 1}/{rounds}: {t.name} ({len(reqs)} requests)")
                sampler = Sampler(servers.pids, servers.metrics) if c == top else contextlib.nullcontext()
                with sampler:
                    runs[t.name][c].append(summarize(*asyncio.run(closed_loop(t, reqs, c))))
                if c == top:
                    merge_peaks(memory["rss_mb"].setdefault(t.name, {}), sampler.rss_mb)
                    for src, gauges in sampler.gauges.items():
                        merge_peaks(memory["engine_gauges"].setdefault(t.name, {}).setdefault(src, {}), gauges)
    return runs, memory


def merge_peaks(into: dict, new: dict) -> None:
    for key, v in new.items():
        into[key] = max(v, into.get(key, float("-inf")))


def ratios_to(runs: dict, baseline: str) -> dict:
    """Per target and level, the median of per-round tokens/s ratios: round r of each ran beside the other's."""
    out = {}
    for name, per_c in runs.items():
        out[name] = {}
        for c, rs in per_c.items():
            pairs = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(rs, runs[baseline][c]) if b["output_tok_s"]]
            out[name][c] = statistics.median(pairs) if pairs else None
    return out


def command_line() -> str:
    """The exact command, the script named relative to the repository (the interpreter is in `machine`)."""
    script = Path(sys.argv[0]).resolve()
    script = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(script), *sys.argv[1:]])


def main() -> int:
    args = build_args().parse_args()
    preset = "quick" if args.quick else "default"
    levels, prompt_range, output_range, n_requests, rounds = PRESETS[preset]
    ints = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    levels = ints(args.concurrency) if args.concurrency else levels
    prompt_range = ints(args.prompt_range) if args.prompt_range else prompt_range
    output_range = ints(args.output_range) if args.output_range else output_range
    n_requests = (lambda c: args.requests) if args.requests else n_requests
    rounds = args.rounds or rounds
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    servers = Servers(externals={n: loopback_url(u) for n, u in parse_pairs(args.target, "--target").items()},
                      pids={n: int(p) for n, p in parse_pairs(args.pid, "--pid").items()},
                      metrics={n: loopback_url(u) for n, u in parse_pairs(args.metrics, "--metrics").items()})
    if not (args.start_stack or args.url or servers.externals or args.llama_server):
        raise SystemExit("nothing to benchmark: give --start-stack, --url, --target or --llama-server")

    progress("tokenizing the corpus")
    corpus, corpus_sha = corpus_ids()
    work = {c: workload(corpus, n_requests(c), args.seed + c, prompt_range, output_range) for c in levels}
    try:
        bring_up(args, servers, out, max(levels), prompt_range[1] + output_range[1] + 16)
        for t in servers.targets:
            progress(f"warming up {t.name} ({t.url}, model {t.model})")
            warm_up(t, corpus[:32])
        runs, memory = run_levels(servers, work, rounds)
    finally:
        servers.stop()

    baseline = args.baseline or next(iter(servers.externals), None)
    baseline = baseline if baseline in runs else None
    results = {n: {c: over_rounds(rs) for c, rs in per_c.items()} for n, per_c in runs.items()}
    ratios = ratios_to(runs, baseline) if baseline else {}
    print_table(results, ratios, baseline)
    for name, per_c in results.items():
        for c, v in per_c.items():
            for msg in v["error_messages"]:
                print(f"error: {name} c={c}: {msg}")
    print(f"medians over {rounds} interleaved rounds; prompts {prompt_range[0]}-{prompt_range[1]} tokens, "
          f"outputs {output_range[0]}-{output_range[1]} tokens (ignore_eos)")
    pngs = plots(out, results, levels)
    for p in pngs:
        print(f"wrote {p}")
    write_json("serve", {
        "command": command_line(), "preset": preset, "rounds": rounds,
        "concurrency": list(levels), "prompt_tokens": list(prompt_range), "output_tokens": list(output_range),
        "requests_per_run": {str(c): len(work[c]) for c in levels}, "seed": args.seed,
        "corpus": {"files": list(CORPUS_FILES), "tokens": len(corpus), "sha256_16": corpus_sha},
        "targets": [{"name": t.name, "url": t.url, "extra_body": t.extra, "model": t.model} for t in servers.targets],
        "baseline": baseline, "processes": servers.pids, "metrics_endpoints": servers.metrics,
        "results": {n: {str(c): v for c, v in per_c.items()} for n, per_c in results.items()},
        "tok_s_ratio_to_baseline": {n: {str(c): v for c, v in per_c.items()} for n, per_c in ratios.items()},
        "memory": memory, "plots": [p.name for p in pngs]}, out_dir=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
