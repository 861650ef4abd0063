"""What a JSON schema costs the engines: tokens/s of `c` concurrent greedy requests through one engine
loop with and without a grammar, and the host time a step spends on the grammars of its rows.

Variants, taking turns within each round (order rotating; medians over rounds):

* greedy: the device's argmax, one token id per row read back;
* logits path: the rows' fp32 logits read back and picked on the host (a no-op logit_bias), what any
  grammar, penalty or logprobs request pays first;
* json_schema: the logits path plus each row's grammar (services/engine/grammar.py): its mask applied
  before the pick, the pick accepted, the next mask filled on the worker thread while the next step runs.

The schema is long enough that no row finishes before `--tokens`. For the json_schema runs the
matchers are timed from inside: per step (all rows), the time the pick waited for a mask still being
filled (`wait`: what the overlap did not hide), the time applying masks (`apply`) and accepting
tokens (`accept`); apply and accept include the wait.

    python -m bench.micro.grammar_cost [--clients 8] [--tokens 32] [--rounds 3] [--engines torch,opencl]
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
from bench._common import machine, progress, table, write_json
from bench.micro.logprobs_cost import make_engine, run_level

from services.engine import grammar as grammar_mod
from services.engine.engine_loop import EngineLoop
from services.engine.grammar import GrammarTokenizer
from services.engine.sampling import SamplingParams
from services.engine.scheduler import SchedulerConfig
from services.gateway.protocol.structured import grammar_of

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "scores"],
          "properties": {"id": {"type": "string", "maxLength": 8},
                         "scores": {"type": "array", "minItems": 40, "maxItems": 40,
                                    "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}


class HostTimer:
    """Seconds the loop thread spends in the matchers, summed (wrapping GrammarMatcher's methods)."""

    def __init__(self):
        self.wait = self.apply = self.accept = 0.0
        self._lock = threading.Lock()
        cls = grammar_mod.GrammarMatcher
        self._orig = {n: getattr(cls, n) for n in ("_wait", "apply", "accept")}
        for name, attr in (("_wait", "wait"), ("apply", "apply"), ("accept", "accept")):
            setattr(cls, name, self._timed(self._orig[name], attr))

    def _timed(self, fn, attr):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with self._lock:
                    setattr(self, attr, getattr(self, attr) + time.perf_counter() - t)
        return wrapper

    def reset(self) -> None:
        self.wait = self.apply = self.accept = 0.0

    def close(self) -> None:
        for name, fn in self._orig.items():
            setattr(grammar_mod.GrammarMatcher, name, fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="torch,opencl")
    args = ap.parse_args()

    from services.model.loading import load_model
    from services.model.tokenizer import load_tokenizer

    loaded = load_model()
    tok = load_tokenizer(loaded.checkpoint)
    grammars = GrammarTokenizer(lambda: tok, loaded.config.vocab_size, loaded.config.eos_token_ids)
    grammars.get()
    variants = {"greedy": {}, "logits path": {"logit_bias": ((0, 0.0),)},
                "json_schema": {"grammar": grammar_of("json_schema", SCHEMA)}}
    rng = np.random.default_rng(0)
    timer = HostTimer()
    results, host = {}, {}
    try:
        for name in args.engines.split(","):
            progress(f"{name}: building the engine")
            engine = make_engine(name, loaded)
            config = SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size,
                                     max_num_seqs=max(args.clients, 1),
                                     max_num_batched_tokens=engine.max_num_batched_tokens, max_model_len=1024)
            loop = EngineLoop(engine, config, loaded.config.eos_token_ids, grammars=grammars)
            per_variant: dict[str, list[float]] = {v: [] for v in variants}
            per_step: dict[str, list[float]] = {"wait": [], "apply": [], "accept": []}
            order = list(variants)
            try:
                run_level(loop, [rng.integers(3, 49152, args.prompt).tolist()], SamplingParams(max_tokens=4, temperature=0))
                for r in range(args.rounds):
                    for v in order[r % len(order):] + order[:r % len(order)]:
                        progress(f"{name}: round {r} {v}")
                        # fresh prompts each time: no prefix-cache hit makes one variant cheaper
                        prompts = [rng.integers(3, 49152, args.prompt).tolist() for _ in range(args.clients)]
                        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, **variants[v])
                        timer.reset()
                        steps_before = loop.steps
                        per_variant[v].append(run_level(loop, prompts, params))
                        if v == "json_schema":
                            steps = loop.steps - steps_before
                            for k in per_step:
                                per_step[k].append(getattr(timer, k) / steps * 1e3)
            finally:
                loop.close()
            base = statistics.median(per_variant["greedy"])
            results[name] = {v: {"tokens_per_s": statistics.median(xs), "rounds": xs,
                                 "vs_greedy": statistics.median(xs) / base} for v, xs in per_variant.items()}
            host[name] = {k: statistics.median(xs) for k, xs in per_step.items()}
    finally:
        timer.close()
    rows = [[e, v, r["tokens_per_s"], f"{(r['vs_greedy'] - 1) * 100:+.1f}%"]
            for e, vs in results.items() for v, r in vs.items()]
    print(table(["engine", "variant", "tokens/s", "vs greedy"], rows))
    print(table([f"engine (json_schema, {args.clients} rows)", "wait ms/step", "apply ms/step", "accept ms/step"],
                [[e, h["wait"], h["apply"], h["accept"]] for e, h in host.items()]))
    write_json("grammar_cost", {"args": vars(args), "machine": machine(), "schema": SCHEMA, "results": results,
                                "host_ms_per_step": host})


if __name__ == "__main__":
    main()
