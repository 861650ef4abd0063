"""`hybridserve bench NAME [ARGS...]` (or `python -m bench NAME [ARGS...]`): the product benchmarks by name.

Each name maps to a module of bench/ whose `main()` parses the remaining arguments itself, so
`hybridserve bench serve --help` is serve.py's own help. The engine and kernel micro-benchmarks are
not named here: they run as `python -m bench.micro.MODULE` (bench/README.md lists them).
"""
from __future__ import annotations

import importlib
import sys

# name -> (module, what it measures); bench/README.md has a section per name
BENCHMARKS: dict[str, tuple[str, str]] = {
    "serve": ("bench.serve", "closed-loop streaming clients at rising concurrency against our modes and llama-server"),
    "suite": ("bench.suite", "every mode and auto over a grid of prompt and output lengths, against transformers"),
    "prefix": ("bench.prefix_cache", "TTFT of a chat load sharing a system prompt, prefix cache on against off"),
    "router": ("bench.router_fresh", "auto's regret on a fresh start while the engines calibrate beside a CPU hog"),
    "fleet": ("bench.fleet_routing", "two pairs behind two gateways: prefix-aware against least-loaded placement"),
    "pools": ("bench.pools", "up --prefill 1 --decode 2 against up --pairs 2"),
    "token-path": ("bench.token_path", "each hop from the engine's step to the client's chunk at one client"),
    "lm-eval": ("bench.lmeval_compare", "lm-evaluation-harness against the stack in each mode and its hf backend"),
    "guidellm": ("bench.guidellm_compare", "guidellm against our stack and llama-server"),
    "cross-host": ("bench.cross_host", "the KV hand-off between two network namespaces over a shaped link (root)"),
    "planner-slo": ("bench.planner_slo", "up --autoscale under rising load: engines wanted and serving, SLOs met"),
    "cold-start": ("bench.cold_start", "the first exchange after a cold start"),
    "long-prompt-gaps": ("bench.long_prompt_gaps", "a stream's largest gaps while long prompts arrive, and the "
                         "engine steps under them"),
    "speculation": ("bench.speculation", "one client, n-gram drafts on and off, against llama-server's n-gram drafts"),
    "structured-eval": ("bench.structured_eval", "structured outputs: valid, schema-valid and agreeing JSON replies"),
    "llama-server": ("bench.llama_server", "build the llama-server baseline once (used by serve, guidellm, ...)"),
}


def usage(prog: str) -> str:
    width = max(map(len, BENCHMARKS))
    rows = "\n".join(f"  {name.ljust(width)}  {what}" for name, (_, what) in BENCHMARKS.items())
    return (f"usage: {prog} NAME [ARGS...]   (NAME --help: that benchmark's options)\n\n"
            f"product benchmarks:\n{rows}\n\n"
            "engine and kernel micro-benchmarks: python -m bench.micro.MODULE (see bench/README.md)")


def main(argv: list[str] | None = None, prog: str = "hybridserve bench") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"{prog}: unknown benchmark {name!r}\n\n{usage(prog)}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[name][0])
    sys.argv = [f"{prog} {name}", *rest]  # the benchmark's argparse reads sys.argv and names itself so
    return module.main() or 0
