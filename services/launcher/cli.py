"""The `hybridserve` command: one-shot generation now; the services join as subcommands."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from services.settings import CommonSettings


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate once from a prompt, without any server")
    p.add_argument("--engine", choices=["torch", "opencl"], default="torch")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text, tokenized as is")
    src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=16, help="OpenAI's default: 16")
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy; OpenAI's default: 1")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS (benchmarks)")
    p.add_argument("--weights-dtype", choices=["auto", "fp32", "fp16", "gguf"], default=None,
                   help="opencl engine: weight storage on the device (auto: gguf for GGUF checkpoints)")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: HYBRIDSERVE_MODEL or SmolLM2)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=_generate)


def _build_engine(args, loaded):
    if args.engine == "torch":
        from services.prefill_gpu.engine import TorchEngine

        return TorchEngine(loaded.config, loaded.weights)
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.settings import DecodeSettings

    overrides = {"weights_dtype": args.weights_dtype} if args.weights_dtype else {}
    return OpenCLEngine.from_settings(loaded, DecodeSettings(**overrides))


def _generate(args) -> int:
    from services.engine.one_request import OneRequest
    from services.model.loading import load_model
    from services.engine.sampling import SamplingParams
    from services.model.tokenizer import chat_prompt_ids, load_tokenizer

    loaded = load_model(args.model or CommonSettings().model)
    tok = load_tokenizer(loaded.checkpoint)
    if args.chat is not None:
        prompt_ids = chat_prompt_ids(tok, [{"role": "user", "content": args.chat}])
    else:
        prompt_ids = tok(args.prompt).input_ids
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    engine = _build_engine(args, loaded)
    gen = OneRequest(engine, prompt_ids, params)  # the engine's paged step, through an engine loop of its own
    ids: list[int] = []
    finish = None
    printed = ""
    for ev in gen:
        ids.append(ev.token)
        finish = ev.finish_reason
        if not args.json:
            # decode the whole text each time so multi-token characters print whole
            text = tok.decode(ids, skip_special_tokens=True)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    text = tok.decode(ids, skip_special_tokens=True)
    if args.json:
        t = gen.timings
        print(json.dumps({"text": text, "token_ids": ids, "finish_reason": finish,
                          "timings": {"prefill_s": t.prefill_s, "decode_s": t.decode_s,
                                      "decode_tokens": max(0, len(ids) - 1)}}))
    else:
        sys.stdout.write(text[len(printed):] + "\n")
    return 0


def _service(module: str):
    def run(_args) -> int:
        import importlib

        return importlib.import_module(module).main()
    return run


def _bench(args) -> int:
    """`hybridserve bench NAME ...`: bench/cli.py's registry, run as `python -m bench` with the checkout on the path
    (bench/ is not part of the installed package, so this needs a checkout)."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / "bench" / "cli.py").is_file():
        print("hybridserve bench: bench/ is not here; run it from a checkout of the project", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    os.execve(sys.executable, [sys.executable, "-m", "bench", *args.bench_args], env)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _add_services(sub) -> None:
    for name, module, what in (("prefill", "services.prefill_gpu.__main__", "the prefill_gpu service (PyTorch)"),
                               ("decode", "services.decode_fpga.__main__", "the decode_fpga service (OpenCL)")):
        p = sub.add_parser(name, help=f"run {what}; settings from HYBRIDSERVE_{name.upper()}_* and the shared "
                                      "HYBRIDSERVE_* variables")
        p.set_defaults(func=_service(module))
    sub.add_parser("gateway", help="run the OpenAI-compatible gateway").set_defaults(
        func=_service("services.gateway.__main__"))
    bench = sub.add_parser("bench", help="run a product benchmark by name (`hybridserve bench --help` lists them; "
                                         "needs a checkout)", add_help=False)
    bench.set_defaults(func=_bench)
    up = sub.add_parser("up", help="run the whole local stack: prefill_gpu, decode_fpga and the gateway")
    up.add_argument("--pairs", type=_positive, default=None,
                    help="(prefill_gpu, decode_fpga) pairs behind the gateway, on ports a stride apart "
                         "(default: HYBRIDSERVE_UP_PAIRS or 1)")
    up.add_argument("--prefill", type=_positive, default=None, dest="prefill_engines",
                    help="pools instead of pairs: this many prefill_gpu engines (with --decode)")
    up.add_argument("--decode", type=_positive, default=None, dest="decode_engines",
                    help="pools: this many decode_fpga engines (any number; with --prefill); the gateway picks "
                         "each hybrid request's prefill and decode engine separately")
    up.add_argument("--autoscale", action="store_true", default=None,
                    help="pools: start and stop engines as the gateway's planner asks, the pools' sizes above "
                         "being the minimums (HYBRIDSERVE_UP_AUTOSCALE; holds and cooldown: HYBRIDSERVE_UP_SCALE_*)")
    up.add_argument("--max-prefill", type=_positive, default=None, dest="max_prefill",
                    help="with --autoscale: at most this many prefill_gpu engines (default: --prefill's)")
    up.add_argument("--max-decode", type=_positive, default=None, dest="max_decode",
                    help="with --autoscale: at most this many decode_fpga engines (default: --decode's)")
    up.set_defaults(func=lambda args: __import__("services.launcher.stack", fromlist=["up"]).up(
        args.pairs, args.prefill_engines, args.decode_engines, args.autoscale, args.max_prefill, args.max_decode))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_services(sub)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = rest  # everything after `bench` belongs to bench/cli.py
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from services.model.checkpoint import CheckpointError

    try:
        # inside: a mistyped HYBRIDSERVE_ variable is a one-line error, not a traceback
        logging.basicConfig(level=CommonSettings().log_level, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except (CheckpointError, ValueError) as exc:
        print(f"hybridserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
