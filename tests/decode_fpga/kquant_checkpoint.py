"""Random GGUF blocks of any type, and tiny Llama GGUF files made of them, written at test time.

gguf-py cannot quantize to the K-quants, and no test may need llama.cpp, but any bytes with
finite, moderate fp16 scales are valid blocks: the blocks here are random bytes with their
scale fields drawn so that weights spread about as widely as a checkpoint's (std ~0.08, so a
random model's logits have clear winners).
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from services.model.gguf_blocks import BlockTensor

# per type: (byte offset of each fp16 scale field, the std of the scale d, of the minimum field), so
# that the weights' std is ~0.08: Q5_0 d (q - 16) has std ~9 d, Q4_K d sc q - dmin mn ~250 d, Q6_K
# d sc (q - 32) ~1400 d; the minimums roughly centre the weights
SCALE_FIELDS = {
    "q5_0": ((0,), 0.009, 0.0), "q5_1": ((0, 2), 0.009, 0.14), "q4_k": ((0, 2), 3e-4, 2e-3),
    "q5_k": ((0, 2), 1.5e-4, 2e-3), "q6_k": ((208,), 6e-5, 0.0), "q2_k": ((80, 82), 2e-3, 2e-3),
    "q3_k": ((108,), 1e-3, 0.0),
}


def ggml_type(qtype: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[qtype.upper()]


def random_raw(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes]: random blocks of `qtype` (a key of SCALE_FIELDS) with sane scales."""
    per, nbytes = gguf.GGML_QUANT_SIZES[ggml_type(qtype)]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    offsets, d_std, m_std = SCALE_FIELDS[qtype]
    for i, off in enumerate(offsets):
        std = d_std if i == 0 else m_std
        vals = (np.abs(rng.normal(size=raw.shape[:2])) * std + std / 4).astype(np.float16)
        raw[..., off:off + 2] = vals.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> BlockTensor:
    return BlockTensor("w", qtype, rows, cols, random_raw(qtype, rows, cols, seed), qtype.upper())


def write_tiny_llama(path: Path, types: dict[str, str], *, n_layers: int = 2, hidden: int = 256,
                     intermediate: int = 512, n_heads: int = 4, n_kv_heads: int = 2, vocab: int = 512,
                     seed: int = 0) -> Path:
    """A tiny Llama GGUF (tied embeddings) whose matrices are random blocks. types: the type of each
    matrix by the end of its GGUF name ("attn_q", ..., "ffn_down", "token_embd"), or by its full name
    ("blk.1.ffn_down"); norms are f32 near 1."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // n_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    shapes = {"attn_q": (hidden, hidden), "attn_k": (n_kv_heads * head_dim, hidden),
              "attn_v": (n_kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (intermediate, hidden), "ffn_up": (intermediate, hidden), "ffn_down": (hidden, intermediate)}
    k = 0

    def matrix(name: str, kind: str, rows: int, cols: int) -> None:
        nonlocal k
        qtype = types.get(name, types[kind])
        k += 1
        w.add_tensor(f"{name}.weight", random_raw(qtype, rows, cols, seed * 1000 + k), raw_dtype=ggml_type(qtype))

    def norm(name: str) -> None:
        w.add_tensor(f"{name}.weight", (1.0 + 0.1 * rng.normal(size=hidden)).astype(np.float32))

    matrix("token_embd", "token_embd", vocab, hidden)
    for i in range(n_layers):
        norm(f"blk.{i}.attn_norm")
        norm(f"blk.{i}.ffn_norm")
        for kind, (rows, cols) in shapes.items():
            matrix(f"blk.{i}.{kind}", kind, rows, cols)
    norm("output_norm")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
