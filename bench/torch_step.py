"""The torch engine's batched step over its paged KV pool against its slot path, same engine, interleaved.

Cases: 1, 4, 8, 16 decodes at context 128 and 512; one 512-token prefill chunk; a mixed step
(8 decodes at 512 + a 256-token prefill chunk: one paged step against the slot path's decode
call plus prefill call). Milliseconds per step, medians over interleaved rounds (this machine's
speed drifts with the other processes on it). KV contents are random: only the time matters.

    python bench/torch_step.py [--rounds N] [--reps N] [--device cpu|cuda] [--out DIR]

Prints a table and writes torch_step.json under bench/results (or --out).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from _common import progress, stats, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from services.engine.batching_settings import BatchingSettings  # noqa: E402
from services.engine.scheduler import ScheduledChunk  # noqa: E402


def timed(fn, reps: int, sync) -> float:
    """Median ms of `reps` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


class Setup:
    """Sequences laid out in both paths: block tables in the pool, and slot-path sequences of the same context."""

    def __init__(self, engine, rng):
        self.engine, self.rng, self.next_block = engine, rng, 0

    def table(self, n_tokens: int) -> list[int]:
        # cases may share blocks once the pool wraps around: only the time is measured
        n = -(-n_tokens // self.engine.block_size)
        blocks = [(self.next_block + i) % self.engine.num_blocks for i in range(n)]
        self.next_block += n
        return blocks

    def decodes(self, batch: int, context: int):
        vocab = self.engine.cfg.vocab_size
        tokens = self.rng.integers(3, vocab, batch).tolist()
        chunks = [ScheduledChunk(i, context, (tokens[i],), tuple(self.table(context + 1)), True, None)
                  for i in range(batch)]
        seqs = [self.engine.new_sequence(context + 1) for _ in range(batch)]
        for s in seqs:
            s.k.normal_(0, 0.5), s.v.normal_(0, 0.5)
        return chunks, seqs, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from services.model.loading import load_model
    from services.prefill_gpu.engine import TorchEngine

    loaded = load_model()
    engine = TorchEngine(loaded.config, loaded.weights, device=args.device,
                         batching=BatchingSettings(kv_cache_mb=512, max_num_batched_tokens=1024))
    engine.kv_pool.data.normal_(0, 0.5)  # random KV (and every page touched before timing)
    cuda = engine.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(engine.device)) if cuda else (lambda: None)
    rng = np.random.default_rng(0)
    setup = Setup(engine, rng)
    vocab = engine.cfg.vocab_size

    cases = {}  # name -> (paged fn, slot fn)
    for context in (128, 512):
        for batch in (1, 4, 8, 16):
            chunks, seqs, tokens = setup.decodes(batch, context)

            def slot(seqs=seqs, tokens=tokens, context=context):
                for s in seqs:
                    s.length = context  # the same position every call
                engine.decode_greedy(seqs, tokens)

            cases[f"decode x{batch} @ctx {context}"] = (lambda chunks=chunks: engine.step(chunks, greedy=True), slot)
    prompt = rng.integers(3, vocab, 512).tolist()
    prefill_chunk = ScheduledChunk(100, 0, tuple(prompt), tuple(setup.table(512)), True, None)

    def slot_prefill(ids=prompt):
        seq = engine.new_sequence(len(ids))
        engine.prefill(seq, ids)

    cases["prefill 512"] = (lambda: engine.step([prefill_chunk], greedy=True), slot_prefill)
    mixed_decodes, mixed_seqs, mixed_tokens = setup.decodes(8, 512)
    part = ScheduledChunk(101, 0, tuple(prompt[:256]), tuple(setup.table(256)), True, None)

    def slot_mixed():
        for s in mixed_seqs:
            s.length = 512
        engine.decode_greedy(mixed_seqs, mixed_tokens)
        slot_prefill(prompt[:256])

    cases["8 decodes @512 + 256 prefill"] = (lambda: engine.step(mixed_decodes + [part], greedy=True), slot_mixed)

    results = {name: {"paged": [], "slot": []} for name in cases}
    for r in range(args.rounds):
        progress(f"round {r + 1}/{args.rounds}")
        for name, (paged, slot) in cases.items():
            order = [("paged", paged), ("slot", slot)] if r % 2 == 0 else [("slot", slot), ("paged", paged)]
            for path, fn in order:
                reps = max(1, args.reps // 3) if "prefill" in name else args.reps
                results[name][path].append(timed(fn, reps, sync))
    rows, payload = [], {}
    for name, by_path in results.items():
        paged, slot = stats(by_path["paged"]), stats(by_path["slot"])
        payload[name] = {"paged_ms": paged, "slot_ms": slot}
        rows.append([name, paged["median"], slot["median"], slot["median"] / paged["median"]])
    print(table(["case", "paged step ms", "slot path ms", "slot/paged"], rows))
    load = os.getloadavg()[0]
    write_json("torch_step" + ("_cuda" if cuda else ""), {
        "device": engine.device_name, "dtype": str(engine.kv_dtype), "rounds": args.rounds, "reps": args.reps,
        "block_size": engine.block_size, "loadavg_1m_after": load, "cases": payload}, args.out)


if __name__ == "__main__":
    main()
