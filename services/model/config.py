"""The model's shape and architecture, read from the checkpoint: one frozen, validated config."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np

from services.model.architecture import (ARCHITECTURES, GGUF_SUPPORTED, ROPE_SCALINGS, SUPPORTED, Architecture,
                                         RopeScaling, by_gguf_name, by_hf_name)
from services.model.checkpoint import Checkpoint, CheckpointError
from services.model.gguf_file import gguf_reader
from services.model.rope_cache import cached_inv_freq

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = SUPPORTED  # Hugging Face model_type values served (architecture.py)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer and its architecture. Everything the engines size buffers from."""

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
    rms_eps: float  # the norms' epsilon (RMSNorm or LayerNorm, as arch.norm says)
    tie_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    arch: Architecture = ARCHITECTURES["llama"]
    rope_scaling: RopeScaling = RopeScaling()
    rope_freq_factors: tuple[float, ...] | None = None  # a GGUF's rope_freqs (llama.cpp's llama3 scaling)

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

    def inv_freq(self) -> np.ndarray:
        """float32 [head_dim / 2]: RoPE's inverse frequencies, scaling applied; zeros for learned positions
        (a rotation by angle 0 is the identity, bit for bit: cos 0 = 1, sin 0 = 0)."""
        if self.arch.positions != "rope":
            return np.zeros(self.head_dim // 2, np.float32)
        factors = None if self.rope_freq_factors is None else np.asarray(self.rope_freq_factors, np.float32)
        return cached_inv_freq(self.rope_theta, self.head_dim, self.rope_scaling, factors)


def read_config(ckpt: Checkpoint) -> ModelConfig:
    return _from_gguf(ckpt) if ckpt.kind == "gguf" else _from_hf(ckpt)


def _refuse(what: str, name, supported) -> CheckpointError:
    return CheckpointError(f"{what} {name!r} is not supported; supported: {', '.join(supported)}")


def _from_gguf(ckpt: Checkpoint) -> ModelConfig:
    try:
        reader = gguf_reader(ckpt.path)
    except Exception as exc:  # the gguf reader raises assorted errors on truncated files
        raise CheckpointError(f"cannot read GGUF file {str(ckpt.path)!r}: {exc}") from exc

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    name = field("general.architecture")
    arch = by_gguf_name(name)
    if arch is None:
        raise _refuse(f"{ckpt.path.name}: GGUF architecture", name, GGUF_SUPPORTED)
    hidden = int(field(f"{name}.embedding_length"))
    n_heads = int(field(f"{name}.attention.head_count"))
    tensors = {t.name: t for t in reader.tensors}
    vocab = field(f"{name}.vocab_size") or len(field("tokenizer.ggml.tokens", []))
    eos = field("tokenizer.ggml.eos_token_id")
    key_length = field(f"{name}.attention.key_length")  # Qwen3 writes its head_dim here
    scaling = field(f"{name}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise _refuse(f"{ckpt.path.name}: GGUF rope scaling", scaling, ("none", "linear", "rope_freqs (llama3)"))
    freq_factors = None
    if "rope_freqs.weight" in tensors:  # llama.cpp's form of llama3 scaling: each frequency divided by its factor
        freq_factors = tuple(float(f) for f in np.asarray(tensors["rope_freqs.weight"].data, np.float32).ravel())
    eps = field(f"{name}.attention.layer_norm_rms_epsilon", field(f"{name}.attention.layer_norm_epsilon"))
    return ModelConfig(
        model_id=ckpt.model_id,
        n_layers=int(field(f"{name}.block_count")),
        hidden=hidden,
        intermediate=int(field(f"{name}.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(field(f"{name}.attention.head_count_kv", n_heads)),
        head_dim=int(key_length or field(f"{name}.rope.dimension_count", hidden // n_heads)),
        vocab_size=int(vocab),
        max_context=int(field(f"{name}.context_length")),
        rope_theta=float(field(f"{name}.rope.freq_base", 10000.0)),
        rms_eps=float(eps),
        tie_embeddings="output.weight" not in tensors,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        arch=arch,
        rope_scaling=(RopeScaling("linear", float(field(f"{name}.rope.scaling.factor", 1.0)))
                      if scaling == "linear" else RopeScaling()),
        rope_freq_factors=freq_factors,
    )


def _rope_scaling(cfg: dict, where: str) -> tuple[float, RopeScaling]:
    """(theta, scaling) from a config.json: transformers 5 writes rope_parameters (theta inside),
    older ones rope_theta and rope_scaling."""
    rope = dict(cfg.get("rope_scaling") or {})
    rope.update(cfg.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_SCALINGS:
        raise _refuse(f"{where}: rope scaling", kind, ROPE_SCALINGS)
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, RopeScaling(kind, **{k: type(getattr(RopeScaling(), k))(rope[k]) for k in keys if k in rope})


def _window_context(cfg: dict, max_pos: int, where: str) -> int:
    """The context served: a sliding window narrower than the model's context caps it there, where
    full attention and the window agree (the engines attend to every cached position)."""
    window = cfg.get("sliding_window")
    uses = cfg.get("use_sliding_window", cfg.get("model_type") == "mistral")  # Qwen's flag; Mistral always
    if not uses or window is None or int(window) >= max_pos:
        return max_pos
    log.warning("%s: sliding window of %d positions (context %d): serving %d positions, where it equals "
                "full attention", where, window, max_pos, window)
    return int(window)


def _from_hf(ckpt: Checkpoint) -> ModelConfig:
    try:
        cfg = json.loads((ckpt.path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {ckpt.path / 'config.json'}: {exc}") from exc
    where = ckpt.path.name
    arch = by_hf_name(cfg.get("model_type"))
    if arch is None:
        raise _refuse(f"{where}: model_type", cfg.get("model_type"), SUPPORTED)
    try:
        return _gpt2_from_hf(ckpt, cfg, arch) if arch.name == "gpt2" else _llama_like_from_hf(ckpt, cfg, arch)
    except KeyError as exc:
        raise CheckpointError(f"{where}: config.json has no {exc.args[0]!r}") from exc


def _eos_ids(ckpt: Checkpoint, cfg: dict) -> tuple[int, ...]:
    """The end-of-sequence ids of config.json and generation_config.json together (Llama 3 Instruct lists
    <|eot_id|> in the latter only, and transformers' generate stops on either)."""
    ids: list[int] = []
    sources = [cfg]
    try:
        sources.append(json.loads((ckpt.path / "generation_config.json").read_text()))
    except (OSError, json.JSONDecodeError):
        pass
    for src in sources:
        eos = src.get("eos_token_id")
        for i in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def _llama_like_from_hf(ckpt: Checkpoint, cfg: dict, arch: Architecture) -> ModelConfig:
    where = ckpt.path.name
    theta, scaling = _rope_scaling(cfg, where)
    if cfg.get("attention_bias") and not arch.qkv_bias or cfg.get("mlp_bias"):
        raise CheckpointError(f"{where}: a {arch.name} with attention_bias/mlp_bias is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(f"{where}: hidden_act", act, ("silu",))
    n_heads = int(cfg["num_attention_heads"])
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    return ModelConfig(
        model_id=ckpt.model_id,
        n_layers=int(cfg["num_hidden_layers"]),
        hidden=int(cfg["hidden_size"]),
        intermediate=int(cfg["intermediate_size"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
        vocab_size=int(cfg["vocab_size"]),
        max_context=_window_context(cfg, max_pos, where),
        rope_theta=theta,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(ckpt, cfg),
        arch=arch,
        rope_scaling=scaling,
    )


def _gpt2_from_hf(ckpt: Checkpoint, cfg: dict, arch: Architecture) -> ModelConfig:
    where = ckpt.path.name
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _refuse(f"{where}: activation_function", act, ("gelu_new", "gelu_pytorch_tanh"))
    if cfg.get("scale_attn_by_inverse_layer_idx") or not cfg.get("scale_attn_weights", True):
        raise CheckpointError(f"{where}: GPT-2 attention scaled other than by 1/sqrt(head_dim) is not supported")
    hidden, n_heads = int(cfg["n_embd"]), int(cfg["n_head"])
    return ModelConfig(
        model_id=ckpt.model_id, n_layers=int(cfg["n_layer"]), hidden=hidden,
        intermediate=int(cfg.get("n_inner") or 4 * hidden), n_heads=n_heads, n_kv_heads=n_heads,
        head_dim=hidden // n_heads, vocab_size=int(cfg["vocab_size"]), max_context=int(cfg["n_positions"]),
        rope_theta=10000.0, rms_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(ckpt, cfg), arch=arch)
