"""Structured outputs evaluated: do JSON replies close, validate and agree with the model's own answer,
in every mode and on llama-server with the same GGUF and the same requests.

The prompts (bench/structured/prompts.jsonl) ask for JSON of different shapes: flat objects, nested
objects, arrays, numbers, enums, a required key among optional ones; a few with `response_format:
json_object`, most with a strict `json_schema`. Each goes to every target three times
(bench/structured/requests.py): `free` (greedy, no format: what the model says unconstrained),
`greedy` (with the format) and `sampled` (with the format; temperature 0.7, top_p 0.9, top_k 40, a
seed per prompt). Targets run one after another, each variant over all prompts `--concurrency` at a
time, streamed.

Per request: whether the reply is one closed JSON object (`valid`) and validates against the schema
(`schema-valid`; for json_object the same), finish_reason, completion tokens, and whether the object
equals the JSON inside the free reply (code fence stripped; `= free`, compared as values). Per target
and variant: those rates, the ITL p50 over every gap between streamed chunks (the grammar's per-token
cost beside the free replies'; bench/grammar_cost.py measures it inside one engine loop), and the
checks of issue 53: schema-valid whenever finish_reason is "stop", and schema-valid at least as often
as llama-server. Prints the table and the checks, writes bench/results/structured_eval.json (every
reply's text) and structured_eval.png.

    python -m bench.structured_eval --start-stack --llama-server auto
    python -m bench.structured_eval --url http://127.0.0.1:8000 --modes auto --limit 8
    python -m bench.structured_eval --start-stack --modes fpga --variants sampled --seeds 5   # a distribution
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from bench._common import RESULTS, ROOT, progress, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.serving.client import Target, loopback_url, served_model, warm_up  # noqa: E402
from bench.serving.report import command_line  # noqa: E402
from bench.serving.servers import Servers, resolve_llama_server  # noqa: E402
from bench.structured.report import by_shape, checks, eval_table, plot, scored, summary  # noqa: E402
from bench.structured.requests import SAMPLED, SYSTEM, VARIANTS, load_prompts, run_phase  # noqa: E402

SEED_STRIDE = 1000  # sampled repeat k draws its seeds from seed + 1000 k on

MODES = ("gpu", "fpga", "hybrid", "auto")


def build_args() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ours = ap.add_mutually_exclusive_group()
    ours.add_argument("--start-stack", action="store_true", help="start our stack on free ports, stop it after")
    ours.add_argument("--url", help="our running gateway")
    ap.add_argument("--modes", default=",".join(MODES), help="our modes to evaluate (comma-separated)")
    ap.add_argument("--llama-server", metavar="PATH|auto",
                    help="start this llama-server binary on the same GGUF; `auto`: the one bench/llama_server.py built")
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--target", action="append", default=[], help="NAME=URL of another OpenAI-compatible server")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="free, greedy, sampled (free: the comparison's "
                                                                   "reference; without it `= free` is not measured)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=53, help="the sampled requests' seeds: this + the prompt's index")
    ap.add_argument("--seeds", type=int, default=1, help="sampled: each prompt this many times, a different seed "
                    "each (seed + 1000 k + the prompt's index): validity rates of a distribution, not of one draw")
    ap.add_argument("--limit", type=int, help="only the first N prompts (a quick look)")
    ap.add_argument("--merge", metavar="JSON", help="a previous run's JSON: its targets that this run does not "
                                                  "measure are kept beside this run's (e.g. llama-server run alone "
                                                  "on a quieter machine); both commands are recorded")
    ap.add_argument("--name", default="structured_eval")
    ap.add_argument("--out", default=str(RESULTS))
    return ap


def relative(path: Path) -> str:
    """A path as the JSON records it: relative to the repository when inside it (no machine's folders)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def bring_up(args, servers: Servers, out: Path) -> list[Target]:
    ours = args.url and loopback_url(args.url)
    if args.start_stack:
        ours = servers.start_stack(out / f"{args.name}_stack.log")
    binary = resolve_llama_server(args.llama_server)
    if binary:
        servers.start_llama_server(binary, args.concurrency, 1024, args.llama_threads, out / f"{args.name}_llama.log")
    targets = []
    if ours:
        model = served_model(ours)
        targets += [Target(f"hybridserve-{m}", ours, {"mode": m}, model) for m in args.modes.split(",")]
    for item in args.target:
        name, _, url = item.partition("=")
        servers.externals[name] = loopback_url(url)
    targets += [Target(name, url, {}, served_model(url)) for name, url in servers.externals.items()]
    if not targets:
        raise SystemExit("nothing to evaluate: give --start-stack, --url, --llama-server or --target")
    return targets


def main() -> None:
    args = build_args().parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts()[:args.limit]
    variants = args.variants.split(",")
    servers = Servers()
    per_target, itl = {}, {}
    try:
        targets = bring_up(args, servers, out)
        for t in targets:
            warm_up(t, [1, 2, 3], progress=progress)
            phases, itl[t.name] = {}, {}
            for variant in variants:
                rows = []
                for k in range(args.seeds if variant == "sampled" else 1):  # greedy and free: one answer each
                    progress(f"{t.name}: {variant}, {len(prompts)} prompts" + (f", seeds #{k + 1}" if k else ""))
                    rows += asyncio.run(run_phase(t, prompts, variant, args.max_tokens, args.seed + SEED_STRIDE * k,
                                                  args.concurrency))
                phases[variant] = rows
                itl[t.name][variant] = [g for r in rows if r["error"] is None for g in r["itl"]]
            per_target[t.name] = scored(prompts, phases)
    finally:
        servers.stop()
    summaries = {name: summary(rows, itl[name]) for name, rows in per_target.items()}
    commands = [command_line()]
    if args.merge:  # the earlier run's targets first, in its order; its summaries as it computed them (ITL)
        earlier = json.loads(Path(args.merge).read_text())
        kept = [n for n in earlier["summary"] if n not in per_target]
        per_target = {**{n: earlier["requests"][n] for n in kept}, **per_target}
        summaries = {**{n: earlier["summary"][n] for n in kept}, **summaries}
        commands = earlier.get("commands", [earlier.get("command")]) + commands
    baseline = "llama-server" if "llama-server" in summaries else None
    results = checks(summaries, baseline)
    print(eval_table(summaries))
    for c in results:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']}: {c['value']}")
    write_json(args.name, {
        "commands": commands, "args": {**vars(args), "out": relative(out)}, "system": SYSTEM, "sampled": SAMPLED,
        "prompts": [p.__dict__ for p in prompts], "summary": summaries, "checks": results,
        "schema_valid_by_shape": {name: by_shape(rows, prompts) for name, rows in per_target.items()},
        "requests": per_target}, out)
    title = f"structured outputs, {len(prompts)} prompts, max_tokens {args.max_tokens}"
    print(f"wrote {plot(out / (args.name + '.png'), summaries, title)}")


if __name__ == "__main__":
    main()
