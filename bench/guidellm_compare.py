"""Our stack against llama-server with a standard load tool: guidellm (PyPI `guidellm`), side by side in one run.

guidellm lives in its own venv (it pins a newer transformers and would pull a CUDA torch: never the
project's venv). Make it once, with the machine's CPU torch held by a constraints file:

    python3 -m venv ~/.cache/hybridserve/guidellm-venv
    echo 'torch==2.13.0+cpu' > /tmp/guidellm-constraints.txt
    ~/.cache/hybridserve/guidellm-venv/bin/pip install -c /tmp/guidellm-constraints.txt guidellm==0.8.1

Then this script starts our stack (`hybridserve up` on free ports) and llama-server on the same GGUF
(`--llama-server PATH|auto`, bench/llama_server.py), saves the served model's tokenizer into a
folder guidellm reads offline (HF_HUB_OFFLINE=1), and runs guidellm against each target in turn,
for each profile: `synchronous` (one request at a time) and `concurrent` (`--concurrency` streams),
each bounded by `--requests`, on guidellm's synthetic prompts of `--prompt-tokens` and outputs of
`--output-tokens` (ignore_eos, /v1/completions, streamed). Everything is on loopback.

Per (target, profile) it keeps guidellm's own figures: output tokens/s, requests/s, TTFT, ITL and
request latency (median and p99), errors; prints a table and writes bench/results/guidellm_compare.json
(guidellm's full report of each run in bench/results/guidellm/<target>_<profile>.json, not committed:
~130 KB each).

    python bench/guidellm_compare.py --llama-server auto [--guidellm PATH] [--requests 16]
        [--concurrency 8] [--prompt-tokens 128] [--output-tokens 64] [--mode auto]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from _common import RESULTS, progress, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from serving.client import served_model  # noqa: E402
from serving.report import command_line  # noqa: E402
from serving.servers import Servers, resolve_llama_server  # noqa: E402

DEFAULT_GUIDELLM = Path("~/.cache/hybridserve/guidellm-venv/bin/guidellm").expanduser()


def save_tokenizer(folder: Path) -> Path:
    """The served model's tokenizer (from its GGUF) as a Hugging Face folder guidellm loads offline."""
    from services.model.checkpoint import locate
    from services.model.tokenizer import load_tokenizer
    from services.settings import CommonSettings

    load_tokenizer(locate(CommonSettings().model)).save_pretrained(folder)
    return folder


def scenario(url: str, model: str, profile: dict, args, tokenizer: Path, out: Path, extra_body: dict) -> dict:
    """A guidellm scenario (its `run --scenario` file) for one target and one profile."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
                    "stream": True, "extras": {"body": {"temperature": 0, "ignore_eos": True, **extra_body}}},
        "profile": profile,
        "constraints": [{"kind": "max_requests", "count": args.requests}],
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                  "output_tokens": args.output_tokens}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "outputs": [{"kind": "json", "path": str(out)}],
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
            "requests": {k: totals.get(k) for k in ("successful", "errored", "incomplete")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--guidellm", default=str(DEFAULT_GUIDELLM), help="the guidellm executable (its own venv)")
    ap.add_argument("--llama-server", metavar="PATH|auto", help="llama-server binary (auto: bench/llama_server.py's)")
    ap.add_argument("--no-stack", action="store_true", help="llama-server only (to try guidellm quickly)")
    ap.add_argument("--mode", default="auto", help="our stack's mode for every request (auto: the router's)")
    ap.add_argument("--requests", type=int, default=16, help="per target and profile")
    ap.add_argument("--concurrency", type=int, default=8)
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
    profiles = {"synchronous": {"kind": "synchronous"},
                f"concurrent{args.concurrency}": {"kind": "concurrent", "streams": [args.concurrency]}}
    servers = Servers()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="guidellm-") as tmp, open(out / f"{args.name}.log", "w") as log:
        work = Path(tmp)
        tokenizer = save_tokenizer(work / "tokenizer")
        try:
            targets = []
            if not args.no_stack:
                url = servers.start_stack(out / f"{args.name}_stack.log")
                targets.append((f"hybridserve-{args.mode}", url, {"mode": args.mode}))
            if llama:
                url = servers.start_llama_server(llama, args.concurrency, args.prompt_tokens + args.output_tokens + 64,
                                                 args.llama_threads, out / f"{args.name}_llama_server.log")
                targets.append(("llama-server", url, {}))
            if not targets:
                raise SystemExit("nothing to run: no stack (--no-stack) and no llama-server")
            for pname, profile in profiles.items():  # each profile: the targets in turn
                for tname, url, extra in targets:
                    progress(f"guidellm {pname} against {tname} ({args.requests} requests)")
                    report_path = out / "guidellm" / f"{tname}_{pname}.json"  # guidellm's whole report (large)
                    report_path.parent.mkdir(exist_ok=True)
                    spec = scenario(url, served_model(url), profile, args, tokenizer, report_path, extra)
                    results.setdefault(tname, {})[pname] = summary(run_guidellm(binary, spec, work, f"{tname}_{pname}",
                                                                                log))
        finally:
            servers.stop()
    rows = []
    f = lambda x: "-" if x is None else f"{x:.4g}"  # noqa: E731
    for tname, per in results.items():
        for pname, r in per.items():
            rows.append([tname, pname, f(r["output_tokens_per_s"]), f(r["requests_per_s"]), f(r["ttft_ms"]["p50"]),
                         f(r["ttft_ms"]["p99"]), f(r["itl_ms"]["p50"]), f(r["itl_ms"]["p99"]),
                         f(r["request_latency_s"]["p50"]), r["requests"]["successful"], r["requests"]["errored"]])
    print(table(["target", "profile", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99", "ITL p50 ms", "ITL p99",
                 "latency p50 s", "ok", "errors"], rows))
    write_json(args.name, {"command": command_line(), "tool": "guidellm", "guidellm": _version(binary),
                           "requests": args.requests, "concurrency": args.concurrency,
                           "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                           "mode": args.mode, "loadavg_1m_after": os.getloadavg()[0], "results": results},
               out_dir=out)
    return 0


def _version(binary: Path) -> str:
    try:
        return subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
