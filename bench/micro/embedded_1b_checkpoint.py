"""A 1B-class Llama GGUF that computes what the default model computes: SmolLM2-135M-Instruct's weights placed
inside a wider model whose other weights are zeros, quantized to Q4_K_M's types.

Why: speculation pays by the drafts the target accepts, and scale_1b_checkpoint.py's 1B-shaped file has random
weights, which copy nothing, so no copy-heavy prompt is ever accepted there. This file reads as many bytes a step
as a 1B model and answers as the default model does, so drafts are accepted as they are on the default model
while each step costs what a 1B step costs.

Shape: hidden 2048, 30 layers (the default model's), 32 heads and 8 KV heads of 64 (Llama-3.2-1B's), intermediate
4096, tied embeddings: 1.17 B parameters. How the default model sits inside it, exactly in real arithmetic:
- the residual stream's first 576 values are the default model's, the rest stay 0: every matrix writing the
  stream (embeddings, attn_output, ffn_down) has zero rows past 576, and every matrix reading it zero columns;
- RMSNorm divides by the mean over 2048 values, 576/2048 of the default model's mean, so the norm weights are
  scaled by sqrt(576/2048) and the epsilon by 576/2048;
- query head h of the default model (9 heads, 3 per KV head) is head (h // 3) * 4 + h % 3 here (4 per KV head),
  so it reads the same KV head; the other heads' queries, keys and values are 0 and attn_output ignores them;
- the feed-forward's first 1536 units are the default model's; the rest have zero gate and up rows (silu(0) * 0)
  and zero ffn_down columns;
- RoPE base, head size, tokenizer: the default model's.
The F16 file (~2.3 GB) is written tensor by tensor and requantized by scale_1b_kquants.py (Q4_K and Q6_K as
Q4_K_M types them); the default model's Q4_1 weights pass through Q4_K there, so the tokens are close to the
default model's, not identical. Nothing here is committed: the files go to scale_1b_checkpoint's cache folder.

    python -m bench.micro.embedded_1b_checkpoint [--dir DIR]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.micro.scale_1b_checkpoint import _tokenizer_fields, cache_dir, ensure_numpy

HIDDEN, N_HEADS, N_KV, FF = 2048, 32, 8, 4096
HEAD = 64
NAME = "smollm2-135m-embedded-1b"


def _source():
    import gguf

    from services.model.checkpoint import default_checkpoint_path

    path = default_checkpoint_path()
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    field = lambda k: reader.fields[f"llama.{k}"].contents()  # noqa: E731
    return path, reader, tensors, field


def _weights(t) -> np.ndarray:
    """A source tensor as float32, [rows, cols] (numpy order) or [n]."""
    from services.model.dequantize import dequantize  # gguf-py's values, in large chunks

    a = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
    return a.reshape(tuple(int(x) for x in reversed(t.shape))) if len(t.shape) > 1 else a.reshape(-1)


def _placed_heads(n_src_heads: int, per_kv_src: int) -> np.ndarray:
    """Where each source query head goes: its KV head's group of 4 here, in order."""
    return np.array([(h // per_kv_src) * (N_HEADS // N_KV) + h % per_kv_src for h in range(n_src_heads)])


def write_f16(path: Path) -> Path:
    """The wide model as an F16 GGUF (llama.cpp's tensor names), each tensor built and written in turn."""
    import gguf

    src_path, _reader, tensors, field = _source()
    h0, ff0 = int(field("embedding_length")), int(field("feed_forward_length"))
    n_layers, heads0, kv0 = int(field("block_count")), int(field("attention.head_count")), int(field("attention.head_count_kv"))
    assert h0 // heads0 == HEAD and int(field("rope.dimension_count")) == HEAD
    r = h0 / HIDDEN  # the share of the wide stream the default model's values fill
    q_at = _placed_heads(heads0, heads0 // kv0)

    def widen(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
        out = np.zeros((rows, cols), np.float32)
        out[:a.shape[0], :a.shape[1]] = a
        return out

    def heads_rows(a: np.ndarray, where: np.ndarray, n: int) -> np.ndarray:
        """[n_src_heads * 64, cols] → [n * 64, cols] with source head i at head where[i]."""
        out = np.zeros((n * HEAD, a.shape[1]), np.float32)
        for i, j in enumerate(where):
            out[j * HEAD:(j + 1) * HEAD] = a[i * HEAD:(i + 1) * HEAD]
        return out

    def layer(i: int, name: str) -> np.ndarray:
        w = lambda k: _weights(tensors[f"blk.{i}.{k}.weight"])  # noqa: E731
        if name in ("attn_norm", "ffn_norm"):
            out = np.zeros(HIDDEN, np.float32)
            out[:h0] = w(name) * np.sqrt(r)
            return out
        if name == "attn_q":
            return widen(heads_rows(w(name), q_at, N_HEADS), N_HEADS * HEAD, HIDDEN)
        if name in ("attn_k", "attn_v"):
            return widen(heads_rows(w(name), np.arange(kv0), N_KV), N_KV * HEAD, HIDDEN)
        if name == "attn_output":  # [hidden out, q heads * 64 in]: columns by head
            a, out = w(name), np.zeros((HIDDEN, N_HEADS * HEAD), np.float32)
            for s, j in enumerate(q_at):
                out[:h0, j * HEAD:(j + 1) * HEAD] = a[:, s * HEAD:(s + 1) * HEAD]
            return out
        if name in ("ffn_gate", "ffn_up"):
            return widen(w(name), FF, HIDDEN)
        if name == "ffn_down":
            return widen(w(name), HIDDEN, FF)
        raise KeyError(name)

    vocab = int(tensors["token_embd.weight"].shape[1])
    shapes = {"attn_q": (N_HEADS * HEAD, HIDDEN), "attn_k": (N_KV * HEAD, HIDDEN), "attn_v": (N_KV * HEAD, HIDDEN),
              "attn_output": (HIDDEN, N_HEADS * HEAD), "ffn_gate": (FF, HIDDEN), "ffn_up": (FF, HIDDEN),
              "ffn_down": (HIDDEN, FF)}
    order: list[tuple[str, tuple[int, ...], object]] = [
        ("token_embd.weight", (vocab, HIDDEN), lambda: widen(_weights(tensors["token_embd.weight"]), vocab, HIDDEN))]
    for i in range(n_layers):
        for k in ("attn_norm", "ffn_norm"):
            order.append((f"blk.{i}.{k}.weight", (HIDDEN,), lambda i=i, k=k: layer(i, k)))
        for k, s in shapes.items():
            order.append((f"blk.{i}.{k}.weight", s, lambda i=i, k=k: layer(i, k)))
    out_norm = np.zeros(HIDDEN, np.float32)
    out_norm[:h0] = _weights(tensors["output_norm.weight"]) * np.sqrt(r)
    order.append(("output_norm.weight", (HIDDEN,), lambda: out_norm))

    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(NAME)
    w.add_context_length(int(field("context_length")))
    w.add_embedding_length(HIDDEN)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(FF)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(HEAD)
    w.add_rope_freq_base(float(field("rope.freq_base")))
    w.add_layer_norm_rms_eps(float(field("attention.layer_norm_rms_epsilon")) * r)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(_tokenizer_fields(w, src_path))
    for name, shape, _ in order:
        matrix = len(shape) == 2
        dt = np.dtype(np.float16 if matrix else np.float32)
        w.add_tensor_info(name, shape, dt, int(np.prod(shape)) * dt.itemsize,
                          gguf.GGMLQuantizationType.F16 if matrix else gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, make in order:
        a = make()
        assert a.shape == shape, (name, a.shape, shape)
        w.write_tensor_data(a.astype(np.float16) if len(shape) == 2 else a)
    w.close()
    tmp.rename(path)
    return path


def ensure(out_dir: Path | None = None) -> Path:
    """The Q4_K_M-typed file, made (F16 written, then requantized) unless it is there already."""
    return ensure_numpy(out_dir, NAME, write_f16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help=f"where the files go (default {cache_dir()})")
    print(ensure(ap.parse_args().dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
