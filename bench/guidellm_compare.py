"""Our stack against llama-server with a standard load tool: guidellm (PyPI `guidellm`), side by side in one run.

guidellm lives in its own venv (it pins a newer transformers and would pull a CUDA torch: never the
project's venv). Make it once, with the machine's CPU torch held by a constraints file:

    python3 -m venv ~/.cache/hybridserve/guidellm-venv
    echo 'torch==2.13.0+cpu' > /tmp/guidellm-constraints.txt
    ~/.cache/hybridserve/guidellm-venv/bin/pip install -c /tmp/guidellm-constraints.txt guidellm==0.8.1

Then this script starts our stack (`hybridserve up` on free ports) and llama-server on the same GGUF
(`--llama-server PATH|auto`, bench/llama_server.py), saves the served model's tokenizer into a
folder guidellm reads offline (HF_HUB_OFFLINE=1), and runs guidellm against each target in turn,
for each profile: `synchronous` (one request at a time) and `concurrent` (each of `--concurrency`'s
stream counts), each bounded by `--requests`, on guidellm's synthetic prompts of `--prompt-tokens` and
outputs of `--output-tokens` (ignore_eos, /v1/completions, streamed). Everything is on loopback.

Fresh prompts for every (round, profile): guidellm draws its synthetic prompts from a seed, and with
one seed every profile repeats the same prompts, so a server with a prompt cache (llama-server keeps
prompts in host memory; our engines keep prefix blocks) answers the second profile from its cache:
llama-server's TTFT at 8 streams was 69 ms with 127 of 128 prompt tokens cached, below its 274 ms for
one request alone. Each (round, profile) gets its own seed (`--seed` + an offset), the same for every
target, so the targets see the same prompts, each once. Rounds rotate the targets' order.

Per (target, profile) it keeps guidellm's own figures: output tokens/s, requests/s, TTFT, ITL and
request latency (median and p99), errors, and the prompt tokens the server said were cached; medians
over rounds; prints a table and writes bench/results/guidellm_compare.json (guidellm's full report of
each run in bench/results/guidellm/<target>_<profile>_r<round>.json, not committed: ~130 KB each).

    python -m bench.guidellm_compare --llama-server auto [--guidellm PATH] [--requests 16] [--rounds 2]
        [--concurrency 8[,32]] [--prompt-tokens 128] [--output-tokens 64] [--mode auto] [--seed N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench._common import RESULTS, progress, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.serving.client import served_model  # noqa: E402
from bench.serving.report import command_line  # noqa: E402
from bench.serving.servers import Servers, resolve_llama_server  # noqa: E402

DEFAULT_GUIDELLM = Path("~/.cache/hybridserve/guidellm-venv/bin/guidellm").expanduser()


def save_tokenizer(folder: Path) -> Path:
    """The served model's tokenizer (from its GGUF) as a Hugging Face folder guidellm loads offline."""
    from services.model.checkpoint import locate
    from services.model.tokenizer import load_tokenizer
    from services.settings import CommonSettings

    load_tokenizer(locate(CommonSettings().model)).save_pretrained(folder)
    return folder


def scenario(url: str, model: str, profile: dict, args, tokenizer: Path, out: Path, extra_body: dict,
             seed: int) -> dict:
    """A guidellm scenario (its `run --scenario` file) for one target and one profile; `seed` picks its prompts."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
                    "stream": True, "extras": {"body": {"temperature": 0, "ignore_eos": True, **extra_body}}},
        "profile": profile,
        "constraints": [{"kind": "max_requests", "count": args.requests}],
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                  "output_tokens": args.output_tokens}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "outputs": [{"kind": "json", "path": str(out)}],
        "seed": {"kind": "static", "value": seed},
    }}


def run_guidellm(binary: Path, spec: dict, work: Path, name: str, log) -> dict:
    path = work / f"{name}.scenario.json"
    path.write_text(json.dumps(spec, indent=1))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost"}
    env.pop("PYTHONPATH", None)  # guidellm's venv, not ours
    proc = subprocess.run([str(binary), "run", "--scenario", str(path), "--disable-console-interactive"],
                          env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"guidellm exited {proc.returncode} for {name}; see {log.name}")
    return json.loads(Path(spec["spec"]["outputs"][0]["path"]).read_text())


def _dist(metrics: dict, key: str, scale: float = 1.0) -> dict:
    """Median and p99 of one of guidellm's metric distributions (successful requests)."""
    d = (metrics.get(key) or {}).get("successful") or {}
    pct = d.get("percentiles") or {}
    med = d.get("median")
    return {"p50": None if med is None else med * scale,
            "p99": None if pct.get("p99") is None else pct["p99"] * scale}


def summary(report: dict) -> dict:
    """The figures we compare, from guidellm's report of one benchmark (its first)."""
    b = report["benchmarks"][0]
    m = b["metrics"]
    totals = m.get("request_totals") or {}
    return {"output_tokens_per_s": (m.get("output_tokens_per_second") or {}).get("successful", {}).get("mean"),
            "requests_per_s": (m.get("requests_per_second") or {}).get("successful", {}).get("mean"),
            "ttft_ms": _dist(m, "time_to_first_token_ms"), "itl_ms": _dist(m, "inter_token_latency_ms"),
            "request_latency_s": _dist(m, "request_latency"),
            "requests": {k: totals.get(k) for k in ("successful", "errored", "incomplete")},
            "cached_prompt_share": _cached_share(b)}


def _cached_share(benchmark: dict) -> float | None:
    """Of the prompt tokens of the successful requests, the share the server said it had cached."""
    reqs = (benchmark.get("requests") or {}).get("successful") or []
    prompt = sum(r.get("prompt_tokens") or 0 for r in reqs)
    cached = [r.get("cached_tokens") for r in reqs]
    if not prompt or all(c is None for c in cached):
        return None
    return sum(c or 0 for c in cached) / prompt


def median_over_rounds(rounds: list[dict]) -> dict:
    """Each figure of `summary`'s shape as its median over the rounds (None where no round has it)."""
    first = rounds[0]
    if isinstance(first, dict):
        return {k: median_over_rounds([r[k] for r in rounds]) for k in first}
    values = [v for v in rounds if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--guidellm", default=str(DEFAULT_GUIDELLM), help="the guidellm executable (its own venv)")
    ap.add_argument("--llama-server", metavar="PATH|auto", help="llama-server binary (auto: bench/llama_server.py's)")
    ap.add_argument("--no-stack", action="store_true", help="llama-server only (to try guidellm quickly)")
    ap.add_argument("--mode", default="auto", help="our stack's mode for every request (auto: the router's)")
    ap.add_argument("--requests", type=int, default=16, help="per target and profile")
    ap.add_argument("--concurrency", default="8", help="stream counts of the concurrent profiles, e.g. 8,32")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every (profile, target); medians over them")
    ap.add_argument("--seed", type=int, default=None, help="first prompt seed (default: from the clock)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--name", default="guidellm_compare")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    binary = Path(args.guidellm).expanduser()
    if not binary.is_file():
        raise SystemExit(f"{binary}: no guidellm there; make its venv as the module docstring says")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llama = resolve_llama_server(args.llama_server)
    streams = [int(c) for c in str(args.concurrency).split(",")]
    profiles = {"synchronous": {"kind": "synchronous"},
                **{f"concurrent{n}": {"kind": "concurrent", "streams": [n]} for n in streams}}
    seed = int(time.time()) % 1_000_000 if args.seed is None else args.seed
    servers = Servers()
    per_round: dict = {}
    with tempfile.TemporaryDirectory(prefix="guidellm-") as tmp, open(out / f"{args.name}.log", "w") as log:
        work = Path(tmp)
        tokenizer = save_tokenizer(work / "tokenizer")
        try:
            targets = []
            if not args.no_stack:
                url = servers.start_stack(out / f"{args.name}_stack.log")
                targets.append((f"hybridserve-{args.mode}", url, {"mode": args.mode}))
            if llama:
                url = servers.start_llama_server(llama, max(streams), args.prompt_tokens + args.output_tokens + 64,
                                                 args.llama_threads, out / f"{args.name}_llama_server.log")
                targets.append(("llama-server", url, {}))
            if not targets:
                raise SystemExit("nothing to run: no stack (--no-stack) and no llama-server")
            for rnd in range(args.rounds):
                order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
                for i, (pname, profile) in enumerate(profiles.items()):  # each profile: the targets in turn
                    prompt_seed = seed + rnd * len(profiles) + i  # fresh prompts, the same for every target
                    for tname, url, extra in order:
                        progress(f"round {rnd + 1}/{args.rounds}: guidellm {pname} against {tname} "
                                 f"({args.requests} requests, seed {prompt_seed})")
                        name = f"{tname}_{pname}_r{rnd + 1}"
                        report_path = out / "guidellm" / f"{name}.json"  # guidellm's whole report (large)
                        report_path.parent.mkdir(exist_ok=True)
                        spec = scenario(url, served_model(url), profile, args, tokenizer, report_path, extra,
                                        prompt_seed)
                        per_round.setdefault(tname, {}).setdefault(pname, []).append(
                            summary(run_guidellm(binary, spec, work, name, log)))
        finally:
            servers.stop()
    results = {t: {p: median_over_rounds(rs) for p, rs in per.items()} for t, per in per_round.items()}
    rows = []
    f = lambda x: "-" if x is None else f"{x:.4g}"  # noqa: E731
    for tname, per in results.items():
        for pname, r in per.items():
            rows.append([tname, pname, f(r["output_tokens_per_s"]), f(r["requests_per_s"]), f(r["ttft_ms"]["p50"]),
                         f(r["ttft_ms"]["p99"]), f(r["itl_ms"]["p50"]), f(r["itl_ms"]["p99"]),
                         f(r["request_latency_s"]["p50"]), f(r["cached_prompt_share"]), r["requests"]["successful"],
                         r["requests"]["errored"]])
    print(table(["target", "profile", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99", "ITL p50 ms", "ITL p99",
                 "latency p50 s", "cached", "ok", "errors"], rows))
    ours = next((t for t in results if t != "llama-server"), None)
    if ours and "llama-server" in results:
        for pname in profiles:
            a, b = results[ours][pname], results["llama-server"][pname]
            if a["output_tokens_per_s"] and b["output_tokens_per_s"] and a["ttft_ms"]["p50"] and b["ttft_ms"]["p50"]:
                tps = a["output_tokens_per_s"] / b["output_tokens_per_s"]
                ttft = a["ttft_ms"]["p50"] / b["ttft_ms"]["p50"]
                print(f"{pname}: {ours} / llama-server tokens/s {tps:.2f}x, TTFT p50 {ttft:.2f}x")
    write_json(args.name, {"command": command_line(), "tool": "guidellm", "guidellm": _version(binary),
                           "requests": args.requests, "concurrency": streams, "rounds": args.rounds,
                           "first_seed": seed, "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens, "mode": args.mode,
                           "loadavg_1m_after": os.getloadavg()[0], "results": results, "per_round": per_round},
               out_dir=out)
    return 0


def _version(binary: Path) -> str:
    try:
        return subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
