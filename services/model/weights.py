"""Model weights as float32 numpy arrays in one structure both engines read.

GGUF checkpoints are dequantized with the `gguf` package (the same code path
`transformers` uses, so the values match the reference bit for bit); Hugging Face
directories are read from safetensors only: pickled checkpoints are refused.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from services.model.checkpoint import Checkpoint, CheckpointError
from services.model.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer; matrices are [out_features, in_features]."""

    attn_norm: np.ndarray  # [hidden]
    wq: np.ndarray  # [q_dim, hidden]
    wk: np.ndarray  # [kv_dim, hidden]
    wv: np.ndarray  # [kv_dim, hidden]
    wo: np.ndarray  # [hidden, q_dim]
    ffn_norm: np.ndarray  # [hidden]
    w_gate: np.ndarray  # [intermediate, hidden]
    w_up: np.ndarray  # [intermediate, hidden]
    w_down: np.ndarray  # [hidden, intermediate]


@dataclass(frozen=True)
class ModelWeights:
    embed: np.ndarray  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray  # [hidden]
    lm_head: np.ndarray  # [vocab, hidden]; the embedding itself when tied

    def nbytes(self) -> int:
        arrays = [self.embed, self.final_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        arrays += [a for layer in self.layers for a in vars(layer).values()]
        return sum(a.nbytes for a in arrays)


_LAYER_KEYS = {  # LayerWeights field → (GGUF suffix, HF suffix)
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "wq": ("attn_q.weight", "self_attn.q_proj.weight"),
    "wk": ("attn_k.weight", "self_attn.k_proj.weight"),
    "wv": ("attn_v.weight", "self_attn.v_proj.weight"),
    "wo": ("attn_output.weight", "self_attn.o_proj.weight"),
    "ffn_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "w_gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "w_up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "w_down": ("ffn_down.weight", "mlp.down_proj.weight"),
}


def load_weights(ckpt: Checkpoint, cfg: ModelConfig) -> ModelWeights:
    start = time.perf_counter()
    tensors = _gguf_tensors(ckpt, cfg) if ckpt.kind == "gguf" else _hf_tensors(ckpt)
    weights = _assemble(tensors, cfg, gguf=ckpt.kind == "gguf")
    log.info("loaded %s weights: %.1f MB fp32 in %.2fs", cfg.model_id, weights.nbytes() / 1e6, time.perf_counter() - start)
    return weights


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs → HF's rotate-half order).

    Works on any row-major array whose first axis is the output row, including
    quantized block rows, because it only reorders rows.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(ckpt: Checkpoint, cfg: ModelConfig) -> dict[str, np.ndarray]:
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(str(ckpt.path))
        out = {}
        for t in reader.tensors:
            arr = dequantize(t.data, t.tensor_type)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            out[t.name] = np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)
    except NotImplementedError as exc:
        raise CheckpointError(f"{ckpt.path.name}: unsupported GGUF tensor type: {exc}") from exc
    except (ValueError, IndexError) as exc:
        raise CheckpointError(f"{ckpt.path.name}: corrupt GGUF tensor data: {exc}") from exc
    for i in range(cfg.n_layers):
        out[f"blk.{i}.attn_q.weight"] = unpermute_rope_rows(out[f"blk.{i}.attn_q.weight"], cfg.n_heads)
        out[f"blk.{i}.attn_k.weight"] = unpermute_rope_rows(out[f"blk.{i}.attn_k.weight"], cfg.n_kv_heads)
    return out


def _hf_tensors(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    files = sorted(ckpt.path.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in ckpt.path.iterdir())
        raise CheckpointError(
            f"{ckpt.path}: no .safetensors files (found {found}); pickled checkpoints (.bin/.pt) are never loaded"
        )
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                out[name] = st.get_tensor(name).float().numpy()
    return out


def _assemble(t: dict[str, np.ndarray], cfg: ModelConfig, gguf: bool) -> ModelWeights:
    prefix = (lambda i: f"blk.{i}.") if gguf else (lambda i: f"model.layers.{i}.")
    pick = 0 if gguf else 1

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in t:
            raise CheckpointError(f"checkpoint {cfg.model_id} has no tensor {name!r}")
        if t[name].shape != shape:
            raise CheckpointError(f"tensor {name!r} has shape {t[name].shape}, expected {shape}")
        return t[name]

    h, q, kv, ff = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.intermediate
    shapes = {"attn_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q),
              "ffn_norm": (h,), "w_gate": (ff, h), "w_up": (ff, h), "w_down": (h, ff)}
    layers = tuple(
        LayerWeights(**{k: get(prefix(i) + names[pick], shapes[k]) for k, names in _LAYER_KEYS.items()})
        for i in range(cfg.n_layers)
    )
    embed = get("token_embd.weight" if gguf else "model.embed_tokens.weight", (cfg.vocab_size, h))
    head_name = "output.weight" if gguf else "lm_head.weight"
    lm_head = embed if cfg.tie_embeddings or head_name not in t else get(head_name, (cfg.vocab_size, h))
    final_norm = get("output_norm.weight" if gguf else "model.norm.weight", (h,))
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
