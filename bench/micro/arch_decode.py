"""Decode ms/token at batch 1 per architecture on the OpenCL engine: what running launch by launch
costs a family whose parts decode_layers.cl does not compute.

Random-weight checkpoints of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads of 64, 3 KV heads,
intermediate 1536, vocabulary 49152) in each family, written as GGUF with Q8_0 matrices
(tests/model/tiny_checkpoints.py's writer), served with the checkpoint's blocks. Per family:
  * 1L    the paged step at batch 1 in one launch (decode_layers.cl, with Qwen2's q/k/v biases and
          Qwen3's q/k head norms)
  * LbL   the same launch by launch (an engine with layer_kernels off): the extra parts as launches of
          their own (arch_parts.py), GPT-2's only way
Interleaved round by round, medians of every round's steps.

    python -m bench.micro.arch_decode [--rounds N] [--steps N]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench._common import progress, stats, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=2048)
FAMILIES = ("llama3", "qwen2", "qwen3")


def checkpoint(family: str, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.model import tiny_checkpoints as tc

    cfg = tc.family_config(family, **SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape) if p.ndim == 1 and "norm" in name else 0.08 * torch.randn(p.shape))
    return tc.save_gguf(model, family, out / f"{family}.gguf")


def engine(path: Path, one_launch: bool):
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.one_launch_choice import OneLaunchChoice
    from services.decode_fpga.settings import DecodeSettings
    from services.model.loading import load_model

    settings = DecodeSettings(kv_cache_mb=64, max_context=512, max_num_batched_tokens=256,
                              opencl_layer_kernels=one_launch)
    e = OpenCLEngine.from_settings(load_model(str(path)), settings)
    e.one_launch_choice = OneLaunchChoice(fixed=one_launch)
    return e


def decode_ms(e, steps: int, context: int = 128) -> list[float]:
    from services.engine.scheduler import ScheduledChunk

    table_ = tuple(range(-(-(context + steps) // e.block_size)))
    token = e.step([ScheduledChunk(0, 0, tuple(range(3, 3 + context)), table_, True, None)], greedy=True)[0]
    out = []
    for i in range(steps):
        t0 = time.perf_counter()
        token = e.step([ScheduledChunk(0, context + i, (token,), table_, True, None)], greedy=True)[0]
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    from services.decode_fpga.arch_parts import one_launch_takes

    with tempfile.TemporaryDirectory() as tmp:
        ways = {}
        for fam in FAMILIES:
            progress(f"building {fam}")
            path = checkpoint(fam, Path(tmp))
            ways[(fam, "LbL")] = engine(path, False)
            if one_launch_takes(ways[(fam, "LbL")].cfg.arch):
                ways[(fam, "1L")] = engine(path, True)
        samples: dict = {k: [] for k in ways}
        for r in range(args.rounds):
            for k, e in ways.items():
                samples[k] += decode_ms(e, args.steps)
            progress(f"round {r + 1}/{args.rounds}")
    rows = [[fam, way, stats(samples[(fam, way)])["median"]] for fam, way in samples]
    print(table(["family", "way", "ms/token (median)"], rows))
    write_json("arch_decode", {"rows": [dict(zip(("family", "way", "ms_per_token"), r)) for r in rows],
                               "samples": {f"{f}/{w}": s for (f, w), s in samples.items()}})


if __name__ == "__main__":
    main()
