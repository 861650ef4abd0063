"""The PyTorch engine against `transformers`, same model, same threads, interleaved rounds.

Prefill tokens/s at 64, 256, 512, 1024 prompt tokens; decode ms/token at batch
1, 4, 16 (sequences of different lengths). Rounds alternate ours / theirs
because this machine's speed drifts by +-25% over minutes.

    python -m bench.micro.engine_torch [--rounds N] [--quick] [--out DIR]

Writes engine_torch.json and engine_torch.png under bench/results (or --out);
the 1-minute load average before and after goes into the JSON, since other
processes on this 2-core machine move the numbers.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench._common import RESULTS, progress, stats, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def chunk(seq_id: int, start: int, tokens, table):
    from services.engine.sequence import ScheduledChunk

    return ScheduledChunk(seq_id, start, tuple(tokens), tuple(table), True, None)


def tables(engine, lengths) -> list[tuple[int, ...]]:
    """Consecutive blocks of the engine's pool, one table per sequence of each length."""
    out, first = [], 0
    for n in lengths:
        used = -(-n // engine.block_size)
        out.append(tuple(range(first, first + used)))
        first += used
    return out


def ours_prefill(engine, ids):
    """The prompt as one chunk of the paged step (the engine is built for prompts of that many rows)."""
    table = tables(engine, [len(ids) + 1])[0]
    t = time.perf_counter()
    engine.step([chunk(0, 0, ids, table)], greedy=True)
    return time.perf_counter() - t


def hf_prefill(model, ids):
    t = time.perf_counter()
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t


def ours_decode(engine, prompts, steps):
    """ms of a paged decode step of one row per prompt, after each prompt's own prefill step."""
    tabs = tables(engine, [len(p) + steps + 1 for p in prompts])
    tokens = [engine.step([chunk(i, 0, p, tab)], greedy=True)[0] for i, (p, tab) in enumerate(zip(prompts, tabs))]
    t = time.perf_counter()
    for k in range(steps):
        tokens = engine.step([chunk(i, len(p) + k, [tok], tab) for i, (p, tok, tab) in
                              enumerate(zip(prompts, tokens, tabs))], greedy=True)
    return (time.perf_counter() - t) / steps


def hf_decode(model, prompts, steps):
    """Left-padded batch with an attention mask and the KV cache, as `generate` runs it."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        past = out.past_key_values
        t = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
            out = model(nxt, attention_mask=mask, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - t) / steps


def plot(path: Path, res: dict) -> Path:
    """Two panels: prefill tokens/s by prompt length, decode ms/step by batch; bars are medians, whiskers min-max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = ((axes[0], res["prefill"], lambda n, s: n / s, "prefill tokens/s (higher is better)", "prompt tokens"),
              (axes[1], res["decode"], lambda n, s: s * 1e3, "decode ms/step (lower is better)", "batch"))
    for ax, part, f, title, xlabel in panels:
        keys = list(part)
        x = np.arange(len(keys))
        for i, (who, key) in enumerate((("ours", "ours_s"), ("transformers", "transformers_s"))):
            med = np.array([f(k, part[k][key]["median"]) for k in keys])
            lo = np.array([min(f(k, part[k][key]["min"]), f(k, part[k][key]["max"])) for k in keys])
            hi = np.array([max(f(k, part[k][key]["min"]), f(k, part[k][key]["max"])) for k in keys])
            ax.bar(x + (i - 0.5) * 0.4, med, 0.4, yerr=[med - lo, hi - med], capsize=3, label=who)
        ax.set_xticks(x, [str(k) for k in keys])
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 rounds, fewer sizes")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    rounds = 2 if args.quick else args.rounds
    prefill_sizes = (64, 512) if args.quick else (64, 256, 512, 1024)
    batches = (1, 4) if args.quick else (1, 4, 16)
    steps = 8 if args.quick else 16

    from services.model.loading import load_model
    from services.model.reference import load_reference
    from services.engine.batching_settings import BatchingSettings
    from services.prefill_gpu.engine import TorchEngine

    progress("loading the model twice: ours and transformers'")
    loaded = load_model()
    # one step takes the longest prompt whole (a server would chunk it)
    ours = TorchEngine(loaded.config, loaded.weights, device="cpu",
                       batching=BatchingSettings(kv_cache_mb=256, max_num_batched_tokens=max(prefill_sizes)))
    hf = load_reference(loaded.checkpoint)
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()[0]
    res = {"prefill": {}, "decode": {}}
    for n in prefill_sizes:
        ids = rng.integers(3, loaded.config.vocab_size, n).tolist()
        ours_prefill(ours, ids), hf_prefill(hf, ids)  # warm-up
        a, b = [], []
        for r in range(rounds):
            progress(f"prefill {n}: round {r + 1}/{rounds}")
            a.append(ours_prefill(ours, ids))
            b.append(hf_prefill(hf, ids))
        res["prefill"][n] = {"ours_s": stats(a), "transformers_s": stats(b)}
    for batch in batches:
        prompts = [rng.integers(3, loaded.config.vocab_size, 20 + 13 * i).tolist() for i in range(batch)]
        a, b = [], []
        for r in range(rounds):
            progress(f"decode batch {batch}: round {r + 1}/{rounds}")
            a.append(ours_decode(ours, prompts, steps))
            b.append(hf_decode(hf, prompts, steps))
        res["decode"][batch] = {"ours_s": stats(a), "transformers_s": stats(b)}
    rows = []
    for n, r in res["prefill"].items():
        o, t = r["ours_s"]["median"], r["transformers_s"]["median"]
        rows.append([f"prefill {n} tok", f"{n / o:.0f} tok/s", f"{n / t:.0f} tok/s", f"{t / o:.2f}x"])
    for bsz, r in res["decode"].items():
        o, t = r["ours_s"]["median"], r["transformers_s"]["median"]
        rows.append([f"decode batch {bsz}", f"{o * 1e3:.1f} ms/step", f"{t * 1e3:.1f} ms/step", f"{t / o:.2f}x"])
    print(table(["what", "ours (median)", "transformers (median)", "speed-up"], rows))
    load_after = os.getloadavg()[0]
    print(f"({rounds} interleaved rounds, torch threads {torch.get_num_threads()}, "
          f"1-min load average {load_before:.2f} before, {load_after:.2f} after)")
    out = Path(args.out)
    write_json("engine_torch", {"rounds": rounds, "decode_steps": steps, "results": res,
                                "load_average_1min": {"before": load_before, "after": load_after}}, out_dir=out)
    plot(out / "engine_torch.png", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
