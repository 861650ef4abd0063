"""The model's shape, read from the checkpoint: one frozen, validated config."""
from __future__ import annotations

import json
from dataclasses import dataclass

from services.model.checkpoint import Checkpoint, CheckpointError

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. Everything the engines size buffers from."""

    model_id: str
    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise CheckpointError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim {self.head_dim} must be even for RoPE")
        if min(self.n_layers, self.hidden, self.intermediate, self.vocab_size, self.max_context) <= 0:
            raise CheckpointError(f"non-positive dimension in model config: {self}")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def read_config(ckpt: Checkpoint) -> ModelConfig:
    return _from_gguf(ckpt) if ckpt.kind == "gguf" else _from_hf(ckpt)


def _from_gguf(ckpt: Checkpoint) -> ModelConfig:
    import gguf

    try:
        reader = gguf.GGUFReader(str(ckpt.path))
    except Exception as exc:  # the gguf reader raises assorted errors on truncated files
        raise CheckpointError(f"cannot read GGUF file {str(ckpt.path)!r}: {exc}") from exc

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{ckpt.path.name}: architecture {arch!r} is not supported (only {SUPPORTED_ARCHITECTURES})")
    hidden = int(field(f"{arch}.embedding_length"))
    n_heads = int(field(f"{arch}.attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens", []))
    eos = field("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_id=ckpt.model_id,
        n_layers=int(field(f"{arch}.block_count")),
        hidden=hidden,
        intermediate=int(field(f"{arch}.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(field(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(field(f"{arch}.rope.dimension_count", hidden // n_heads)),
        vocab_size=int(vocab),
        max_context=int(field(f"{arch}.context_length")),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _from_hf(ckpt: Checkpoint) -> ModelConfig:
    try:
        cfg = json.loads((ckpt.path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {ckpt.path / 'config.json'}: {exc}") from exc
    if cfg.get("model_type") not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{ckpt.path.name}: model_type {cfg.get('model_type')!r} is not supported (only {SUPPORTED_ARCHITECTURES})"
        )
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise CheckpointError(f"{ckpt.path.name}: rope scaling {scaling!r} is not supported")
    eos = cfg.get("eos_token_id")
    n_heads = int(cfg["num_attention_heads"])
    return ModelConfig(
        model_id=ckpt.model_id,
        n_layers=int(cfg["num_hidden_layers"]),
        hidden=int(cfg["hidden_size"]),
        intermediate=int(cfg["intermediate_size"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads", n_heads)),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
        vocab_size=int(cfg["vocab_size"]),
        max_context=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
    )
