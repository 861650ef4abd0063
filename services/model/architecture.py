"""What a model architecture is, in one place: its norms, positions, biases, extra norms and MLP.

Both engines and the loaders read an `Architecture`; none of them branch on a family's name.
A family is one entry of ARCHITECTURES: its description and where its tensors are named in a
Hugging Face checkpoint (safetensors) and in a GGUF file (llama.cpp's names). Adding a family
(Gemma, Phi, ...) whose parts are already here is one entry and its test (a tiny config in
tests/model/tiny_checkpoints.py, a case of tests/model/test_architecture_engines.py); a part not here yet (another norm, another activation) is a
field here plus its implementation in each engine, switched on by the field, never by the name.

Canonical tensor names (what the name tables map to; `{i}` is the layer):

    embed, pos_embed, final_norm, final_norm_b, lm_head
    layers.{i}.attn_norm, attn_norm_b, wq, wk, wv, bq, bk, bv, wqkv, bqkv (a fused q|k|v, split on
    load), q_norm, k_norm, wo, bo, ffn_norm, ffn_norm_b, w_gate, b_gate, w_up, b_up, w_down, b_down

Matrices are [out, in] once loaded; a family stored [in, out] (GPT-2's Conv1D) says so
(`hf_transposed`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

NORMS = ("rms", "layer")  # RMSNorm (weight only); LayerNorm (weight and bias, mean subtracted)
POSITIONS = ("rope", "learned")  # rotary (rotate-half, HF's order); a learned absolute table added to the embedding
MLPS = ("silu_gated", "gelu_tanh")  # down(silu(gate(x)) * up(x)); down(gelu_tanh(up(x)))
ROPE_SCALINGS = ("default", "linear", "llama3")  # rope_type values served


@dataclass(frozen=True)
class Architecture:
    """One family's structure. Every field is a switch both engines implement."""

    name: str  # the Hugging Face model_type
    gguf_name: str | None  # GGUF general.architecture; None: not loaded from GGUF yet
    norm: str = "rms"  # NORMS
    positions: str = "rope"  # POSITIONS
    qkv_bias: bool = False  # q, k and v projections have biases
    out_bias: bool = False  # the attention output projection has a bias
    mlp_bias: bool = False  # the MLP's projections have biases
    qk_norm: bool = False  # RMSNorm of every q and k head (weights [head_dim]) before RoPE
    mlp: str = "silu_gated"  # MLPS
    gguf_rope_permuted: bool = True  # llama.cpp stores q/k rows interleaved (its "normal" rope), to undo
    hf_transposed: bool = False  # HF layer matrices stored [in, out] (Conv1D)
    hf_names: dict[str, str] = field(default_factory=dict, repr=False)  # canonical name → HF tensor name
    gguf_names: dict[str, str] = field(default_factory=dict, repr=False)  # canonical name → GGUF tensor name

    def __post_init__(self) -> None:
        assert self.norm in NORMS and self.positions in POSITIONS and self.mlp in MLPS, self

    @property
    def gated(self) -> bool:
        return self.mlp == "silu_gated"

    def wanted(self) -> list[str]:
        """The canonical per-layer tensors this family has (without the `layers.{i}.` prefix)."""
        names = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_up", "w_down"]
        names += ["attn_norm_b", "ffn_norm_b"] if self.norm == "layer" else []
        names += ["bq", "bk", "bv"] if self.qkv_bias else []
        names += ["bo"] if self.out_bias else []
        names += ["q_norm", "k_norm"] if self.qk_norm else []
        names += ["w_gate"] if self.gated else []
        names += (["b_up", "b_down"] + (["b_gate"] if self.gated else [])) if self.mlp_bias else []
        return names


# ---- the name tables ------------------------------------------------------------------------------
_HF_LLAMA = {
    "embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight",
    "layers.{i}.attn_norm": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    **{f"layers.{{i}}.{w}{p}": f"model.layers.{{i}}.self_attn.{p}_proj.{kind}"
       for p in "qkvo" for w, kind in (("w", "weight"), ("b", "bias"))},
    **{f"layers.{{i}}.{w}_{p}": f"model.layers.{{i}}.mlp.{p}_proj.{kind}"
       for p in ("gate", "up", "down") for w, kind in (("w", "weight"), ("b", "bias"))},
}
_GGUF_LLAMA = {
    "embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight",
    "pos_embed": "position_embd.weight", "final_norm_b": "output_norm.bias",
    "layers.{i}.attn_norm": "blk.{i}.attn_norm.weight", "layers.{i}.attn_norm_b": "blk.{i}.attn_norm.bias",
    "layers.{i}.ffn_norm": "blk.{i}.ffn_norm.weight", "layers.{i}.ffn_norm_b": "blk.{i}.ffn_norm.bias",
    "layers.{i}.q_norm": "blk.{i}.attn_q_norm.weight", "layers.{i}.k_norm": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.wqkv": "blk.{i}.attn_qkv.weight", "layers.{i}.bqkv": "blk.{i}.attn_qkv.bias",
    **{f"layers.{{i}}.{w}{p}": f"blk.{{i}}.attn_{g}.{kind}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                        ("o", "output"))
       for w, kind in (("w", "weight"), ("b", "bias"))},
    **{f"layers.{{i}}.{w}_{p}": f"blk.{{i}}.ffn_{p}.{kind}" for p in ("gate", "up", "down")
       for w, kind in (("w", "weight"), ("b", "bias"))},
}
_HF_GPT2 = {  # GPT2LMHeadModel's names with the "transformer." prefix dropped (GPT2Model's own)
    "embed": "wte.weight", "pos_embed": "wpe.weight", "final_norm": "ln_f.weight", "final_norm_b": "ln_f.bias",
    "lm_head": "lm_head.weight",
    "layers.{i}.attn_norm": "h.{i}.ln_1.weight", "layers.{i}.attn_norm_b": "h.{i}.ln_1.bias",
    "layers.{i}.wqkv": "h.{i}.attn.c_attn.weight", "layers.{i}.bqkv": "h.{i}.attn.c_attn.bias",
    "layers.{i}.wo": "h.{i}.attn.c_proj.weight", "layers.{i}.bo": "h.{i}.attn.c_proj.bias",
    "layers.{i}.ffn_norm": "h.{i}.ln_2.weight", "layers.{i}.ffn_norm_b": "h.{i}.ln_2.bias",
    "layers.{i}.w_up": "h.{i}.mlp.c_fc.weight", "layers.{i}.b_up": "h.{i}.mlp.c_fc.bias",
    "layers.{i}.w_down": "h.{i}.mlp.c_proj.weight", "layers.{i}.b_down": "h.{i}.mlp.c_proj.bias",
}

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", "llama", hf_names=_HF_LLAMA, gguf_names=_GGUF_LLAMA),
    # Mistral is Llama's structure; its sliding window is handled by the config (config.py)
    Architecture("mistral", "llama", hf_names=_HF_LLAMA, gguf_names=_GGUF_LLAMA),
    Architecture("qwen2", "qwen2", qkv_bias=True, gguf_rope_permuted=False, hf_names=_HF_LLAMA,
                 gguf_names=_GGUF_LLAMA),
    Architecture("qwen3", "qwen3", qk_norm=True, gguf_rope_permuted=False, hf_names=_HF_LLAMA,
                 gguf_names=_GGUF_LLAMA),
    Architecture("gpt2", None, norm="layer", positions="learned", qkv_bias=True, out_bias=True, mlp_bias=True,
                 mlp="gelu_tanh", hf_transposed=True, hf_names=_HF_GPT2),
)}
SUPPORTED = tuple(ARCHITECTURES)
GGUF_SUPPORTED = tuple(sorted({a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name}))


def by_hf_name(model_type: str | None) -> Architecture | None:
    return ARCHITECTURES.get(model_type or "")


def by_gguf_name(arch: str | None) -> Architecture | None:
    """The description of a GGUF general.architecture (a Mistral GGUF says "llama")."""
    return next((a for a in ARCHITECTURES.values() if a.gguf_name == arch and a.name == arch), None)


# ---- rotary frequencies ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RopeScaling:
    """A rope_scaling (rope_parameters) entry of a config: its type and parameters."""

    rope_type: str = "default"  # ROPE_SCALINGS
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


def rope_inv_freq(theta: float, head_dim: int, scaling: RopeScaling = RopeScaling(),
                  freq_factors: np.ndarray | None = None) -> np.ndarray:
    """float32 [head_dim / 2]: RoPE's inverse frequencies, with transformers' arithmetic (torch float32
    tensors against Python scalars, step by step as its rope init functions), so both engines' angles are
    the reference's bit for bit. freq_factors: a GGUF's rope_freqs tensor (llama.cpp divides each
    frequency by its factor)."""
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:
        inv = inv / torch.from_numpy(np.asarray(freq_factors, np.float32))
    elif scaling.rope_type == "linear":
        inv = inv / scaling.factor
    elif scaling.rope_type == "llama3":
        # wavelengths shorter than old / high_freq_factor kept, longer than old / low_freq_factor divided by
        # factor, those between interpolated
        old, low, high, factor = (scaling.original_max_position_embeddings, scaling.low_freq_factor,
                                  scaling.high_freq_factor, scaling.factor)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        inv = torch.where(medium, smoothed, scaled)
    elif scaling.rope_type != "default":
        raise ValueError(f"rope scaling {scaling.rope_type!r} is not supported (only {ROPE_SCALINGS})")
    return inv.numpy().astype(np.float32)
