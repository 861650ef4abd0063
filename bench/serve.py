"""Serving benchmark: closed-loop streaming clients against OpenAI-compatible servers, interleaved.

At each concurrency level (default 1, 2, 4, 8, 16, 32) `c` clients each send their next request
as soon as the previous one has finished, until the level's fixed-seed list of requests is done:
prompts of 32-512 token ids cut from real text tokenized with the served model's tokenizer, outputs
of 64-256 tokens with `ignore_eos` and `temperature: 0`, streamed from `/v1/completions`. Every
target gets the same prompt lengths and output lengths: our stack once per mode (`gpu`, `fpga`,
`hybrid`, `auto` through the `mode` body field) and llama.cpp's `llama-server` on the same GGUF
(`--llama-server PATH|auto`) or any server given with `--target`. Each prompt's first token is
unique in the run, so no server serves a repeat from its prefix cache (see serving/workload.py), and
drawn afresh each run (`--salt-seed` fixes them), so a server still up from an earlier run does not either.
Targets take turns within each round (the order rotates round by round) and every figure is the
median over rounds, so drift on a noisy, shared machine falls on all targets alike.

Per (target, concurrency): output tokens/s and requests/s (over the wall time of the level),
TTFT, ITL (gaps between streamed text chunks) and end-to-end p50/p99, errors and the first
messages. At the highest concurrency it also samples each process's RSS and the engines' KV and
queue gauges from their Prometheus endpoints (whatever exists; absence is tolerated). Then the
long-prompt variant (serving/long_prompts.py): running streams' ITL p99 while 512-token prompts
arrive (`--long-prompt-tokens` sets their length, `--only-long-prompts` runs only this variant). It
prints tables, writes `<name>.json` (`serve`, or `serve_vs_llama` with llama-server, or
`serve_long_prompts[_N]`; with the exact command line) and `<name>_throughput.png`, `<name>_latency.png`.

Why a small asyncio + httpx client and not an established load generator: guidellm and locust
are not installed here, and neither does what this measurement needs without as much code again.
locust is a generic HTTP load tool: streaming TTFT/ITL would be our own code inside its tasks.
guidellm benchmarks one server per invocation, with prompts it generates as text; we need the same
token ids sent to every target (our gateway and llama-server would each re-tokenize text), targets
interleaved at each concurrency level inside one run, and the servers' RSS and KV gauges sampled
while the load is on. Both would add a large dependency tree for a loop of ~60 lines.

    python -m bench.serve --start-stack [--llama-server PATH|auto] [--quick] [--repeats 3]
    python -m bench.serve --start-stack --only-long-prompts --long-prompt-tokens 2000 --rounds 2
    python -m bench.serve --url http://127.0.0.1:8000 --target llama-server=http://127.0.0.1:8080
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from bench._common import RESULTS, progress, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.serving.client import Target, closed_loop, loopback_url, served_model, warm_up  # noqa: E402
from bench.serving.long_prompts import streams_with_arrivals  # noqa: E402
from bench.serving.probe import Sampler, cpu_seconds, cpu_used  # noqa: E402
from bench.serving.report import (LATENCY_PANELS, THROUGHPUT_PANELS, command_line, ms,  # noqa: E402
                            plot_against_concurrency, serve_table)
from bench.serving.servers import Servers, resolve_llama_server  # noqa: E402
from bench.serving.stats import merge_peaks, over_rounds, ratios_to, summarize  # noqa: E402
from bench.serving.workload import CORPUS_FILES, Salter, corpus_ids, salt_seed, workload  # noqa: E402

MODES = ("gpu", "fpga", "hybrid", "auto")


@dataclass(frozen=True)
class Preset:
    levels: tuple[int, ...]
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    min_requests: int  # per level and round: max(min_requests, 2 x clients)
    rounds: int
    long_streams: int  # the long-prompt variant: streams running, their output tokens,
    long_stream_output: int
    long_prompt: int  # the arriving prompts' tokens and output tokens
    long_output: int


PRESETS = {
    "default": Preset((1, 2, 4, 8, 16, 32), (32, 512), (64, 256), 8, 3, 4, 256, 512, 16),
    "quick": Preset((1, 2), (32, 256), (16, 48), 2, 2, 2, 48, 512, 4),
}


def build_args() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="concurrency 1,2, short outputs, few requests (a test)")
    ours = ap.add_mutually_exclusive_group()
    ours.add_argument("--start-stack", action="store_true", help="start our stack on free ports, stop it after")
    ours.add_argument("--url", help="our running gateway (its modes become targets)")
    ap.add_argument("--modes", default=",".join(MODES), help="our modes to measure (comma-separated)")
    ap.add_argument("--target", action="append", default=[], help="NAME=URL of another OpenAI-compatible server")
    ap.add_argument("--llama-server", metavar="PATH|auto",
                    help="start this llama-server binary on the same GGUF; `auto`: the one bench/llama_server.py built")
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--pid", action="append", default=[], help="NAME=PID whose RSS to record")
    ap.add_argument("--metrics", action="append", default=[], help="NAME=URL of a Prometheus endpoint to sample")
    ap.add_argument("--baseline", help="target the tokens/s ratio is taken against (default: the first external)")
    ap.add_argument("--concurrency", help="comma-separated levels (overrides the preset)")
    ap.add_argument("--requests", type=int, help="requests per level and round (default: max(8, 2c))")
    ap.add_argument("--prompt-range", help="MIN,MAX prompt tokens")
    ap.add_argument("--output-range", help="MIN,MAX output tokens")
    ap.add_argument("--rounds", "--repeats", type=int, dest="rounds", help="interleaved rounds (medians over them)")
    ap.add_argument("--no-long-prompts", action="store_true", help="skip the long-prompts-arrive variant")
    ap.add_argument("--long-streams", type=int, help="streams running while long prompts arrive")
    ap.add_argument("--long-prompt-tokens", type=int, help="the arriving prompts' tokens (default: the preset's 512)")
    ap.add_argument("--long-at-once", type=int, default=1,
                    help="long prompts that arrive together, the next wave once they are answered (default 1)")
    ap.add_argument("--only-long-prompts", action="store_true",
                    help="run only the long-prompts-arrive variant (no concurrency levels): cheap; writes "
                         "serve_long_prompts.json (serve_long_prompts_N.json for N-token prompts other than 512)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="also measure each of our modes with these extra body fields (e.g. logprobs5='{\"logprobs\": 5}'"
                         " or a response_format): the API features' cost, side by side with the plain requests")
    ap.add_argument("--stack-variant", action="append", default=[], metavar="NAME=JSON",
                    help="with --start-stack: also start a second stack with these environment variables (e.g. "
                         "nostretch='{\"HYBRIDSERVE_DECODE_TTFT_TARGET_S\": \"0\"}') and measure each mode on it too: "
                         "a setting's effect, side by side in one run")
    ap.add_argument("--stack-variant-modes", help="the modes measured on the --stack-variant stacks (default: --modes; "
                                                   "e.g. auto alone when the setting only changes the router)")
    ap.add_argument("--seed", type=int, default=16, help="the workload: prompts, their lengths, the outputs' lengths")
    ap.add_argument("--salt-seed", type=int,
                    help="the prompts' unique first tokens (default: drawn afresh each run and written to the JSON). "
                         "Fixed, a second run against the same --url or --target finds the first run's prompts in "
                         "the servers' prefix caches: hybrid at 32 clients answered in 0.4 s instead of 17")
    ap.add_argument("--name", help="output name (default: serve, or serve_vs_llama with llama-server)")
    ap.add_argument("--out", default=str(RESULTS))
    return ap


def parse_pairs(items: list[str], what: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"{what} must be NAME=VALUE, got {item!r}")
        pairs[name] = value
    return pairs


def bring_up(args, servers: Servers, out: Path, max_clients: int, ctx_per_slot: int) -> list[Target]:
    ours_url = args.url and loopback_url(args.url)
    if args.start_stack:
        ours_url = servers.start_stack(out / "serve_stack.log")
    if args.llama_server:
        servers.start_llama_server(args.llama_server, max_clients, ctx_per_slot, args.llama_threads,
                                   out / "serve_llama_server.log")
    targets = []
    if ours_url:
        model = served_model(ours_url)
        targets += [Target(f"hybridserve-{m}", ours_url, {"mode": m}, model) for m in args.modes.split(",")]
        for name, body in parse_pairs(args.variant, "--variant").items():
            targets += [Target(f"hybridserve-{m}+{name}", ours_url, {"mode": m, **json.loads(body)}, model)
                        for m in args.modes.split(",")]
    for name, env in parse_pairs(args.stack_variant, "--stack-variant").items():
        if not args.start_stack:
            raise SystemExit("--stack-variant needs --start-stack")
        url = servers.start_stack(out / f"serve_stack_{name}.log", extra_env=json.loads(env), name=name)
        targets += [Target(f"hybridserve-{m}@{name}", url, {"mode": m}, served_model(url))
                    for m in (args.stack_variant_modes or args.modes).split(",")]
    return targets + [Target(n, u, {}, served_model(u)) for n, u in servers.externals.items()]


def in_turn(targets: list[Target], r: int) -> list[Target]:
    k = r % len(targets)  # rotate the order, so no target always runs first
    return targets[k:] + targets[:k]


def run_levels(targets: list[Target], servers: Servers, work: dict, rounds: int, salt: Salter) -> tuple[dict, dict]:
    """Every level, every round, every target in turn; the sampler runs at the highest level only."""
    top = max(work)
    runs = {t.name: {c: [] for c in work} for t in targets}
    memory = {"concurrency": top, "rss_mb": {}, "engine_gauges": {}}
    for c, reqs in work.items():
        for r in range(rounds):
            for t in in_turn(targets, r):
                progress(f"c={c} round {r + 1}/{rounds}: {t.name} ({len(reqs)} requests)")
                sampler = Sampler(servers.pids, servers.metrics) if c == top else contextlib.nullcontext()
                cpu_before = cpu_seconds(servers.pids)
                with sampler:
                    summary = summarize(*asyncio.run(closed_loop(t, reqs, c, salt)))
                # every process's CPU during this target's run: the idle targets' share shows what they take
                summary["cpu_s"] = cpu_used(cpu_before, cpu_seconds(servers.pids))
                runs[t.name][c].append(summary)
                if c == top:
                    merge_peaks(memory["rss_mb"].setdefault(t.name, {}), sampler.rss_mb)
                    for src, gauges in sampler.gauges.items():
                        merge_peaks(memory["engine_gauges"].setdefault(t.name, {}).setdefault(src, {}), gauges)
    return runs, memory


def run_long_prompts(targets: list[Target], p: Preset, corpus: list[int], seed: int, rounds: int,
                     salt: Salter, at_once: int = 1) -> dict:
    """Per target: the streams quiet, then the same streams while long prompts arrive; medians over rounds."""
    streams = workload(corpus, p.long_streams, seed, (64, 64), (p.long_stream_output, p.long_stream_output))
    longs = [prompt for prompt, _ in workload(corpus, 16, seed + 1, (p.long_prompt, p.long_prompt), (1, 1))]
    runs = {t.name: {"quiet": [], "arrivals": []} for t in targets}
    for r in range(rounds):
        for t in in_turn(targets, r):
            for cond in ("quiet", "arrivals"):
                progress(f"long prompts round {r + 1}/{rounds}: {t.name} {p.long_streams} streams, {cond}")
                runs[t.name][cond].append(asyncio.run(streams_with_arrivals(
                    t, streams, longs, p.long_output, cond == "arrivals", salt, at_once=at_once)))
    return {n: {cond: over_rounds(rs) for cond, rs in per.items()} for n, per in runs.items()}


def long_prompts_table(results: dict) -> str:
    rows = []
    for name, per in results.items():
        for cond, v in per.items():
            m = v["median"]
            over = m.get("stream_gaps_over_150ms")
            rows.append([name, cond, ms(m["stream_itl_p50"]), ms(m["stream_itl_p99"]), ms(m["stream_itl_max"]),
                         "-" if over is None else f"{100 * over:.1f}",
                         "-" if m["arrivals"] is None else f"{m['arrivals']:.0f}", ms(m["arrival_ttft_p50"]),
                         sum(r["stream_errors"] + r["arrival_errors"] for r in v["rounds"])])
    return table(["target", "long prompts", "stream ITL p50 ms", "p99", "max", "gaps > 150 ms %", "arrivals",
                  "their TTFT p50 ms",
                  "errors"], rows)


def default_name(args, p: Preset) -> str:
    if args.only_long_prompts:
        return ("serve_long_prompts" + ("" if p.long_prompt == PRESETS["default"].long_prompt else f"_{p.long_prompt}")
                + ("" if args.long_at_once == 1 else f"_x{args.long_at_once}"))
    return "serve_vs_llama" if args.llama_server else "serve"


def shown_path(path: str) -> str:
    """`path` with the home folder written as ~ (the llama-server binary lives under ~/.cache)."""
    home = str(Path.home())
    return "~" + path[len(home):] if path.startswith(home + os.sep) else Path(path).name


def main() -> int:
    args = build_args().parse_args()
    preset_name = "quick" if args.quick else "default"
    p = PRESETS[preset_name]
    ints = lambda s: tuple(int(v) for v in s.split(","))  # noqa: E731
    levels = ints(args.concurrency) if args.concurrency else p.levels
    prompt_range = ints(args.prompt_range) if args.prompt_range else p.prompt_range
    output_range = ints(args.output_range) if args.output_range else p.output_range
    n_requests = (lambda c: args.requests) if args.requests else (lambda c: max(p.min_requests, 2 * c))
    if args.long_streams:
        p = Preset(**{**p.__dict__, "long_streams": args.long_streams})
    if args.long_prompt_tokens:
        p = Preset(**{**p.__dict__, "long_prompt": args.long_prompt_tokens})
    if args.only_long_prompts and args.no_long_prompts:
        raise SystemExit("--only-long-prompts and --no-long-prompts leave nothing to run")
    rounds = args.rounds or p.rounds
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.llama_server = resolve_llama_server(args.llama_server)
    servers = Servers(externals={n: loopback_url(u) for n, u in parse_pairs(args.target, "--target").items()},
                      pids={n: int(v) for n, v in parse_pairs(args.pid, "--pid").items()},
                      metrics={n: loopback_url(u) for n, u in parse_pairs(args.metrics, "--metrics").items()})
    if not (args.start_stack or args.url or servers.externals or args.llama_server):
        raise SystemExit("nothing to benchmark: give --start-stack, --url, --target or --llama-server")
    name = args.name or default_name(args, p)

    progress("tokenizing the corpus")
    corpus, corpus_sha = corpus_ids()
    work = {c: workload(corpus, n_requests(c), args.seed + c, prompt_range, output_range) for c in levels}
    run_salt = salt_seed(args.salt_seed)
    salt = Salter(run_salt)
    ctx_per_slot = max(prompt_range[1] + output_range[1], p.long_prompt + p.long_output) + 16
    load_before = os.getloadavg()  # latency on a shared 2-core machine says little without it
    try:
        targets = bring_up(args, servers, out, max(max(levels), p.long_streams + 1), ctx_per_slot)
        for t in targets:
            progress(f"warming up {t.name} ({t.url}, model {t.model})")
            warm_up(t, salt(corpus[:32]), progress=progress)
        runs, memory = ({}, {}) if args.only_long_prompts else run_levels(targets, servers, work, rounds, salt)
        long_results = {} if args.no_long_prompts else run_long_prompts(targets, p, corpus, args.seed, rounds, salt,
                                                                        args.long_at_once)
    finally:
        servers.stop()

    baseline = args.baseline or next(iter(servers.externals), None)
    baseline = baseline if baseline in runs else None
    results = {n: {c: over_rounds(rs) for c, rs in per_c.items()} for n, per_c in runs.items()}
    ratios = ratios_to(runs, baseline) if baseline else {}
    if results:
        print(serve_table(results, ratios, baseline))
        for target, per_c in results.items():
            for c, v in per_c.items():
                for msg in v["error_messages"]:
                    print(f"error: {target} c={c}: {msg}")
        print(f"medians over {rounds} interleaved rounds; prompts {prompt_range[0]}-{prompt_range[1]} tokens, "
              f"outputs {output_range[0]}-{output_range[1]} tokens (ignore_eos)")
    if long_results:
        print(f"\n{p.long_streams} streams of {p.long_stream_output} tokens while {p.long_prompt}-token prompts "
              f"arrive {'back to back' if args.long_at_once == 1 else f'{args.long_at_once} at once, wave after wave'} "
              f"({p.long_output} output tokens each), medians over {rounds} rounds:")
        print(long_prompts_table(long_results))
        for target, per in long_results.items():
            for cond, v in per.items():
                for msg in v["error_messages"]:
                    print(f"error: {target} long prompts {cond}: {msg}")
    if not args.llama_server and not servers.externals:
        print("note: no llama-server in this run (give --llama-server PATH|auto)")
    print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}".format(
        *load_before, *os.getloadavg()))
    pngs = [] if not results else [
        plot_against_concurrency(out / f"{name}_throughput.png", results, levels, THROUGHPUT_PANELS,
                                 "Throughput against concurrency"),
        plot_against_concurrency(out / f"{name}_latency.png", results, levels, LATENCY_PANELS,
                                 "Latency against concurrency")]
    for png in pngs:
        print(f"wrote {png}")
    write_json(name, {
        "command": command_line(), "preset": preset_name, "rounds": rounds,
        "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
        "concurrency": list(levels), "prompt_tokens": list(prompt_range), "output_tokens": list(output_range),
        "requests_per_run": {str(c): len(work[c]) for c in levels},
        "output_tokens_per_run": {str(c): sum(n for _, n in work[c]) for c in levels}, "seed": args.seed,
        "salt_seed": run_salt, "unique_first_token": True,
        "corpus": {"files": list(CORPUS_FILES), "tokens": len(corpus), "sha256_16": corpus_sha},
        # a model id that is a file path (llama-server's) and the binary are recorded by name: not this machine's paths
        "targets": [{"name": t.name, "url": t.url, "extra_body": t.extra, "model": Path(t.model).name} for t in targets],
        "llama_server": args.llama_server and shown_path(args.llama_server), "baseline": baseline, "processes": servers.pids,
        "metrics_endpoints": servers.metrics,
        "results": {n: {str(c): v for c, v in per_c.items()} for n, per_c in results.items()},
        "tok_s_ratio_to_baseline": {n: {str(c): v for c, v in per_c.items()} for n, per_c in ratios.items()},
        "memory": memory,
        "long_prompts": {"streams": p.long_streams, "stream_output": p.long_stream_output,
                         "prompt_tokens": p.long_prompt, "output_tokens": p.long_output,
                         "at_once": args.long_at_once, "results": long_results},
        "plots": [png.name for png in pngs]}, out_dir=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
