"""Where speculation stops paying as the batch grows: decode tokens/s of B concurrent greedy requests through
one engine loop with n-gram drafts on and off, B = 1, 2, 4, 8, ..., copy-heavy and chat prompts.

The loop speculates at every batch size here (`max_batch` lifted to the largest B; `--served-limits`: the
served defaults instead, where beyond `max_batch` only drafts from a long match run), and each request turns
drafts on or off for itself (`SamplingParams.speculative`), so the two variants share the engine, its
kernels and its prefix cache and take turns within each round (order rotating, medians over rounds). The
decode rate of a level is the sum over its requests of (tokens - 1) / (last token - first token): the rows
decoding side by side, prefill left out. The batch size where drafts on falls below drafts off is what
`HYBRIDSERVE_*_SPECULATIVE_MAX_BATCH` should be (docs/speculation.md). Each level's greedy tokens with drafts on
and off are compared in its first round, and a difference stops the run: a figure of wrong tokens is no figure
(on a lent H200 the torch engine's drafts once skipped tokens and this benchmark printed a rate for them).

    python -m bench.micro.speculation_batch [--engines opencl,torch] [--batches 1,2,4,8,16] [--k 8]
    python -m bench.micro.speculation_batch --gguf FILE ...  (the OpenCL engine on another GGUF file with the
        default model's tokenizer, e.g. bench/micro/scale_1b_checkpoint.py's 1B-shaped one)
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

from bench._common import RESULTS, machine, progress, table, write_json
from bench.micro.logprobs_cost import make_engine
from bench.speculation import CHAT, chat_ids, copy_prompts

from services.engine.batching_settings import BatchingSettings
from services.engine.engine_loop import EngineLoop
from services.engine.runtime import speculation_config
from services.engine.sampling import SamplingParams
from services.engine.scheduler import SchedulerConfig
from services.engine.speculation import SpeculationConfig

VARIANTS = ("drafts", "no drafts")


def decode_rate(loop: EngineLoop, prompts: list[list[int]], tokens: int, speculative: bool,
                texts: list | None = None) -> float:
    """The summed decode tokens/s of the prompts' requests run at once; each request's tokens into `texts`."""
    rates = [0.0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, speculative=speculative)

    def one(i: int) -> None:
        times = []
        for event in loop.submit(prompts[i], params):
            times.append(time.perf_counter())
            outs[i].append(event.token)
        if len(times) > 1 and times[-1] > times[0]:
            rates[i] = (len(times) - 1) / (times[-1] - times[0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if texts is not None:
        texts.extend(outs)
    return sum(rates)


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (engine, workload), levels in results.items():
        bs = sorted(int(b) for b in levels)
        ax.plot(bs, [levels[str(b)]["ratio"] for b in bs], marker="o", label=f"{engine}, {workload}")
    ax.axhline(1.0, color="grey", linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests decoding at once")
    ax.set_ylabel("decode tokens/s, drafts on / off")
    ax.set_title("Speculation against batch size (k drafts, greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="opencl")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="speculation_batch")
    ap.add_argument("--served-limits", action="store_true",
                    help="the served max_batch and max_batch_long (BatchingSettings') instead of drafts at every B")
    ap.add_argument("--max-batch-long", type=int, default=None,
                    help="with --served-limits: speculative_max_batch_long instead of the served default")
    ap.add_argument("--gguf", default=None, help="the OpenCL engine on this GGUF file (its tokenizer the default's)")
    args = ap.parse_args()
    if args.max_batch_long is not None and not args.served_limits:
        ap.error("--max-batch-long changes the served limits (--served-limits)")
    if args.gguf and args.engines != "opencl":
        ap.error("--gguf runs the OpenCL engine only (--engines opencl)")

    from services.model.loading import load_model
    from services.model.tokenizer import load_tokenizer

    batches = [int(b) for b in args.batches.split(",")]
    loaded = load_model()
    tok = load_tokenizer(loaded.checkpoint)
    workloads = {"copy-heavy": [chat_ids(tok, p) for p in copy_prompts()],
                 "chat": [chat_ids(tok, p) for p in CHAT]}
    results: dict = {}
    for name in args.engines.split(","):
        progress(f"{name}: building the engine")
        if args.gguf:  # a file whose weights only the OpenCL engine holds (scale_1b.py's light load)
            from pathlib import Path

            from bench.micro.scale_1b import our_engine

            engine = our_engine(Path(args.gguf), 2048, tuple(batches))
        else:
            engine = make_engine(name, loaded)
        served = {"speculative_k": args.k} if args.max_batch_long is None else \
            {"speculative_k": args.k, "speculative_max_batch_long": args.max_batch_long}
        speculation = (speculation_config(BatchingSettings(**served)) if args.served_limits
                       else SpeculationConfig(k=args.k, max_batch=max(batches)))
        config = SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size,
                                 max_num_seqs=max(batches), max_num_batched_tokens=engine.max_num_batched_tokens,
                                 max_model_len=2048,
                                 speculation=speculation)
        loop = EngineLoop(engine, config, engine.cfg.eos_token_ids if args.gguf else loaded.config.eos_token_ids)
        try:
            decode_rate(loop, workloads["chat"][:1], 4, True)  # warm: kernels built, pools touched
            for workload, prompts in workloads.items():
                levels = {}
                for b in batches:
                    batch = [prompts[i % len(prompts)] for i in range(b)]
                    runs = {v: [] for v in VARIANTS}
                    texts: dict[str, list] = {v: [] for v in VARIANTS}
                    for r in range(args.rounds):
                        for v in VARIANTS[r % 2:] + VARIANTS[:r % 2]:
                            progress(f"{name} {workload} batch {b}: round {r + 1}/{args.rounds} {v}")
                            runs[v].append(decode_rate(loop, batch, args.tokens, v == "drafts",
                                                       texts[v] if r == 0 else None))
                    # greedy: drafts must not change a token (a run that did measured something else)
                    if texts["drafts"] != texts["no drafts"]:
                        differ = sum(a != b for a, b in zip(texts["drafts"], texts["no drafts"]))
                        raise SystemExit(f"{name} {workload} batch {b}: {differ} of {len(batch)} requests' tokens "
                                         "differ with drafts on and off (greedy): the engine's speculation is wrong")
                    on, off = statistics.median(runs["drafts"]), statistics.median(runs["no drafts"])
                    levels[str(b)] = {"drafts_tok_s": on, "no_drafts_tok_s": off, "ratio": on / off, "runs": runs}
                results[(name, workload)] = levels
        finally:
            loop.close()
    rows = [[engine, workload, b, f"{v['drafts_tok_s']:.1f}", f"{v['no_drafts_tok_s']:.1f}", f"{v['ratio']:.2f}"]
            for (engine, workload), levels in results.items() for b, v in levels.items()]
    print(table(["engine", "prompts", "batch", "drafts tok/s", "no drafts tok/s", "on / off"], rows))
    write_json(args.name, {"machine": machine(), "args": vars(args),
                           "results": {f"{e}/{w}": levels for (e, w), levels in results.items()}})
    plot(results, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
