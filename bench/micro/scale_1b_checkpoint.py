"""The 1B-class scale point's checkpoint: a Llama-3.2-1B-shaped GGUF of seeded random weights,
quantized to Q4_K_M by llama.cpp's own `llama-quantize`.

Shape: hidden 2048, 16 layers, 32 heads, 8 KV heads (head_dim 64), intermediate 8192, tied
embeddings, RoPE base 500000 (no rope scaling: it does not change what decode reads), the default
model's tokenizer (its GGUF's tokenizer.* fields copied: vocab 49152), 1.07 B parameters. Weights
are N(0, 0.02) (a speed measurement: what matters is the bytes, not the logits), norms 1. The F16
file (~2.1 GB) is written tensor by tensor, so the model is never whole in memory, then quantized
(~0.8 GB). Nothing here is committed: both files go to a cache directory and are reused.

Without llama.cpp, --numpy quantizes the F16 file with scale_1b_kquants.py instead (Q4_K_M's choice of
Q4_K and Q6_K, simpler scales than llama.cpp's): NAME.Q4_K_M-numpy.gguf, the same bytes a step.

    python -m bench.micro.scale_1b_checkpoint --quantize /path/to/llama-quantize [--dir DIR]
    python -m bench.micro.scale_1b_checkpoint --numpy [--dir DIR]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

import numpy as np

SHAPE = dict(hidden=2048, n_layers=16, n_heads=32, n_kv_heads=8, intermediate=8192)
SEED, STD = 0, 0.02
NAME = "llama-1b-shaped-random"


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDSERVE_SCALE_CACHE", "~/.cache/hybridserve/scale_1b")).expanduser()


def _tokenizer_fields(writer, src: Path) -> int:
    """Copy every tokenizer.* key of the GGUF `src` into writer; their vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    vocab = 0
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            vocab = len(f.contents())
    return vocab


def write_f16(path: Path) -> Path:
    """The F16 GGUF (llama.cpp's tensor names), streamed: tensor infos first, then each tensor's data."""
    import gguf

    from services.model.checkpoint import default_checkpoint_path

    h, n_layers, ff = SHAPE["hidden"], SHAPE["n_layers"], SHAPE["intermediate"]
    n_heads, n_kv = SHAPE["n_heads"], SHAPE["n_kv_heads"]
    head_dim = h // n_heads
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(NAME)
    w.add_context_length(8192)
    w.add_embedding_length(h)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = _tokenizer_fields(w, default_checkpoint_path())
    w.add_vocab_size(vocab)
    mats = {"attn_q": (h, h), "attn_k": (n_kv * head_dim, h), "attn_v": (n_kv * head_dim, h),
            "attn_output": (h, h), "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}
    order: list[tuple[str, tuple[int, ...], bool]] = [("token_embd.weight", (vocab, h), True)]
    for i in range(n_layers):
        order += [(f"blk.{i}.attn_norm.weight", (h,), False), (f"blk.{i}.ffn_norm.weight", (h,), False)]
        order += [(f"blk.{i}.{k}.weight", s, True) for k, s in mats.items()]
    order.append(("output_norm.weight", (h,), False))
    for name, shape, matrix in order:
        dt = np.float16 if matrix else np.float32
        w.add_tensor_info(name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize,
                          gguf.GGMLQuantizationType.F16 if matrix else gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(SEED)
    for name, shape, matrix in order:
        a = ((rng.standard_normal(shape, dtype=np.float32) * STD).astype(np.float16) if matrix
             else np.ones(shape, np.float32))
        w.write_tensor_data(a)
    w.close()
    tmp.rename(path)
    return path


def ensure_f16(out_dir: Path, name: str = NAME, write: Callable[[Path], Path] = write_f16) -> Path:
    """The F16 file `name` both quantizations start from, written by `write` unless it is there already."""
    f16 = out_dir / f"{name}.F16.gguf"
    if not f16.exists():
        t = time.perf_counter()
        write(f16)
        print(f"wrote {f16} ({f16.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f}s", flush=True)
    return f16


def ensure(quantize: str | Path, out_dir: Path | None = None) -> Path:
    """The Q4_K_M file, made (F16 written, then llama-quantize) unless it is there already."""
    out_dir = out_dir or cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    q = out_dir / f"{NAME}.Q4_K_M.gguf"
    if q.exists():
        return q
    f16 = ensure_f16(out_dir)
    t = time.perf_counter()
    part = q.with_suffix(".part")
    done = subprocess.run([str(quantize), str(f16), str(part), "Q4_K_M", "2"], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama-quantize failed ({done.returncode}):\n{done.stderr[-3000:]}")
    part.rename(q)
    print(f"quantized {q} ({q.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f}s", flush=True)
    return q


def ensure_numpy(out_dir: Path | None = None, name: str = NAME, write: Callable[[Path], Path] = write_f16) -> Path:
    """The Q4_K_M-typed file quantized by scale_1b_kquants.py (no llama.cpp) from the F16 file `write` makes (by
    default this module's random one), made unless it is there."""
    from bench.micro.scale_1b_kquants import requantize

    out_dir = out_dir or cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    q = out_dir / f"{name}.Q4_K_M-numpy.gguf"
    if q.exists():
        return q
    f16 = ensure_f16(out_dir, name, write)
    t = time.perf_counter()
    counts = requantize(f16, q)
    print(f"quantized {q} ({q.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f}s: {counts}", flush=True)
    return q


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", default=None, help="llama.cpp's llama-quantize")
    ap.add_argument("--numpy", action="store_true", help="quantize with scale_1b_kquants.py instead")
    ap.add_argument("--dir", type=Path, default=None, help=f"where the files go (default {cache_dir()})")
    args = ap.parse_args()
    if not args.numpy and not args.quantize:
        ap.error("give --quantize PATH (llama.cpp's llama-quantize) or --numpy")
    print(ensure_numpy(args.dir) if args.numpy else ensure(args.quantize, args.dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
