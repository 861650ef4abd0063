"""Model weights as float32 numpy arrays in one structure both engines read.

GGUF checkpoints are dequantized with the `gguf` package's block arithmetic (the code
`transformers` uses, so the values match the reference bit for bit; in larger chunks of
rows, services/model/dequantize.py); Hugging Face
directories are read from safetensors only: pickled checkpoints are refused.
Which tensors a layer has, and what each is called in either kind of checkpoint, is the
architecture's (services/model/architecture.py); this module only reads and checks them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

import numpy as np

from services.model.checkpoint import Checkpoint, CheckpointError
from services.model.config import ModelConfig
from services.model.gguf_file import gguf_reader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer; matrices are [out_features, in_features]. None: the architecture has no such tensor."""

    attn_norm: np.ndarray  # [hidden]
    wq: np.ndarray  # [q_dim, hidden]
    wk: np.ndarray  # [kv_dim, hidden]
    wv: np.ndarray  # [kv_dim, hidden]
    wo: np.ndarray  # [hidden, q_dim]
    ffn_norm: np.ndarray  # [hidden]
    w_gate: np.ndarray | None  # [intermediate, hidden]; None in a non-gated MLP
    w_up: np.ndarray  # [intermediate, hidden]
    w_down: np.ndarray  # [hidden, intermediate]
    attn_norm_b: np.ndarray | None = None  # [hidden] (LayerNorm)
    ffn_norm_b: np.ndarray | None = None
    bq: np.ndarray | None = None  # [q_dim]
    bk: np.ndarray | None = None  # [kv_dim]
    bv: np.ndarray | None = None  # [kv_dim]
    bo: np.ndarray | None = None  # [hidden]
    q_norm: np.ndarray | None = None  # [head_dim]: RMSNorm of each query head (Qwen3)
    k_norm: np.ndarray | None = None  # [head_dim]
    b_gate: np.ndarray | None = None  # [intermediate]
    b_up: np.ndarray | None = None  # [intermediate]
    b_down: np.ndarray | None = None  # [hidden]

    def arrays(self) -> list[np.ndarray]:
        return [a for a in (getattr(self, f.name) for f in fields(self)) if a is not None]


@dataclass(frozen=True)
class ModelWeights:
    embed: np.ndarray  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray  # [hidden]
    lm_head: np.ndarray  # [vocab, hidden]; the embedding itself when tied
    final_norm_b: np.ndarray | None = None  # [hidden] (LayerNorm)
    pos_embed: np.ndarray | None = None  # [max_positions, hidden]: learned absolute positions

    def nbytes(self) -> int:
        arrays = [self.embed, self.final_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        arrays += [a for a in (self.final_norm_b, self.pos_embed) if a is not None]
        arrays += [a for layer in self.layers for a in layer.arrays()]
        return sum(a.nbytes for a in arrays)

    @property
    def has_matrices(self) -> bool:
        """False when loaded with gguf_matrices=False: the matrices are empty [0, cols] arrays."""
        return self.embed.shape[0] > 0


# a layer's matrices and the two embeddings: what gguf_matrices=False leaves in the file
MATRICES = ("embed", "lm_head", *(f"layers.{{i}}.{k}" for k in ("wq", "wk", "wv", "wo", "wqkv", "w_gate", "w_up",
                                                                   "w_down")))


def load_weights(ckpt: Checkpoint, cfg: ModelConfig, gguf_matrices: bool = True) -> ModelWeights:
    """The checkpoint's weights as fp32. gguf_matrices=False: a GGUF checkpoint's matrices (MATRICES)
    stay in the file, empty [0, cols] arrays in their place (their shapes still checked), for an
    engine that reads them from the file's own blocks (decode_fpga's gguf storage): the process
    then never dequantizes the ~0.5 GB of fp32 it would not read (the default model: 3-4 s of a
    start, and its memory held for the process's life)."""
    start = time.perf_counter()
    skip = frozenset() if gguf_matrices or ckpt.kind != "gguf" else _gguf_matrix_names(cfg)
    shapes: dict[str, tuple[int, ...]] = {}
    tensors = _gguf_tensors(ckpt, cfg, skip, shapes) if ckpt.kind == "gguf" else _hf_tensors(ckpt)
    weights = _assemble(tensors, cfg, gguf=ckpt.kind == "gguf", file_shapes=shapes)
    log.info("loaded %s (%s) weights: %.1f MB fp32 in %.2fs%s", cfg.model_id, cfg.arch.name, weights.nbytes() / 1e6,
             time.perf_counter() - start, "" if weights.has_matrices else " (the matrices stay in the file)")
    return weights


def _gguf_matrix_names(cfg: ModelConfig) -> frozenset[str]:
    names = cfg.arch.gguf_names
    return frozenset(names[k].format(i=i) for k in MATRICES if k in names for i in range(cfg.n_layers))


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs → HF's rotate-half order).

    Works on any row-major array whose first axis is the output row, including
    quantized block rows and biases, because it only reorders rows.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(ckpt: Checkpoint, cfg: ModelConfig, skip: frozenset[str] = frozenset(),
                  shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
    """Every tensor dequantized to fp32, those in `skip` as empty [0, cols] arrays (their shapes in
    `shapes`)."""
    from services.model.dequantize import dequantize

    try:
        reader = gguf_reader(ckpt.path)
        out = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if t.name in skip:
                out[t.name] = np.empty((0, *shape[1:]), np.float32)
                if shapes is not None:
                    shapes[t.name] = shape
                continue
            arr = dequantize(t.data, t.tensor_type)
            out[t.name] = np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)
    except NotImplementedError as exc:
        raise CheckpointError(f"{ckpt.path.name}: unsupported GGUF tensor type: {exc}") from exc
    except (ValueError, IndexError) as exc:
        raise CheckpointError(f"{ckpt.path.name}: corrupt GGUF tensor data: {exc}") from exc
    if cfg.arch.gguf_rope_permuted:
        for i in range(cfg.n_layers):
            for part, heads in (("q", cfg.n_heads), ("k", cfg.n_kv_heads)):
                for kind in ("weight", "bias"):
                    name = f"blk.{i}.attn_{part}.{kind}"
                    if name in out and name not in skip:
                        out[name] = unpermute_rope_rows(out[name], heads)
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
                # GPT2LMHeadModel prefixes GPT2Model's names with "transformer."
                out[name.removeprefix("transformer.")] = st.get_tensor(name).float().numpy()
    return out


def _assemble(t: dict[str, np.ndarray], cfg: ModelConfig, gguf: bool,
              file_shapes: dict[str, tuple[int, ...]] | None = None) -> ModelWeights:
    """file_shapes: the shapes of the tensors left in the file (empty arrays in `t`), checked as the others'."""
    file_shapes = file_shapes or {}
    arch = cfg.arch
    names = arch.gguf_names if gguf else arch.hf_names
    transposed = arch.hf_transposed and not gguf
    h, q, kv, ff, hd = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.intermediate, cfg.head_dim
    shapes = {"attn_norm": (h,), "attn_norm_b": (h,), "ffn_norm": (h,), "ffn_norm_b": (h,),
              "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q), "bq": (q,), "bk": (kv,), "bv": (kv,),
              "bo": (h,), "q_norm": (hd,), "k_norm": (hd,), "w_gate": (ff, h), "w_up": (ff, h), "w_down": (h, ff),
              "b_gate": (ff,), "b_up": (ff,), "b_down": (h,), "wqkv": (q + 2 * kv, h), "bqkv": (q + 2 * kv,)}

    def find(canonical: str, i: int | None = None) -> np.ndarray | None:
        key = names.get(canonical if i is None else f"layers.{{i}}.{canonical}")
        key = None if key is None else key.format(i=i)
        if key is None or key not in t:
            return None
        a = t[key]
        return a.T if transposed and i is not None and a.ndim == 2 else a  # (the embeddings are [rows, hidden])

    def get(canonical: str, shape: tuple[int, ...], i: int | None = None) -> np.ndarray:
        a = find(canonical, i)
        what = canonical if i is None else f"layer {i} {canonical}"
        if a is None:
            raise CheckpointError(f"checkpoint {cfg.model_id} ({arch.name}) has no {what} tensor")
        key = names.get(canonical if i is None else f"layers.{{i}}.{canonical}", "").format(i=i)
        if file_shapes.get(key, a.shape) != shape:
            raise CheckpointError(f"{what} tensor has shape {file_shapes.get(key, a.shape)}, expected {shape}")
        return np.ascontiguousarray(a, np.float32)

    def layer(i: int) -> LayerWeights:
        wanted = arch.wanted()
        got = {}
        for fused, parts in (("wqkv", ("wq", "wk", "wv")), ("bqkv", ("bq", "bk", "bv"))):
            if parts[0] in wanted and find(parts[0], i) is None and find(fused, i) is not None:
                whole = get(fused, shapes[fused], i)  # one q|k|v tensor (GPT-2): split at q and kv rows
                got.update(zip(parts, np.split(whole, [q, q + kv])))
        got.update({k: get(k, shapes[k], i) for k in wanted if k not in got})
        return LayerWeights(**{"w_gate": None, **{k: np.ascontiguousarray(v) for k, v in got.items()}})

    layers = tuple(layer(i) for i in range(cfg.n_layers))
    embed = get("embed", (cfg.vocab_size, h))
    lm_head = embed if cfg.tie_embeddings or find("lm_head") is None else get("lm_head", (cfg.vocab_size, h))
    layer_norm = arch.norm == "layer"
    return ModelWeights(embed=embed, layers=layers, final_norm=get("final_norm", (h,)), lm_head=lm_head,
                        final_norm_b=get("final_norm_b", (h,)) if layer_norm else None,
                        pos_embed=(get("pos_embed", (find("pos_embed").shape[0] if find("pos_embed") is not None
                                                     else cfg.max_context, h))
                                   if arch.positions == "learned" else None))
