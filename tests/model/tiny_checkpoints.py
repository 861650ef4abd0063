"""Tiny checkpoints of every served family, made at test time with transformers (no download).

Weights are seeded and drawn wider than a fresh init (std 0.08, norms around 1) so greedy picks
have clear winners; the default model's tokenizer is saved beside them (its vocabulary is the
models' vocabulary). Every family has the same attention shape where it can (hidden 128, 4 heads of
32, 2 KV heads), so the OpenCL programs built for one serve the others.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB = 49152  # the default model's tokenizer
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # small, so the test's positions reach scaled and smoothed frequencies
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}


def family_config(family: str, **shape_overrides):
    """The tiny config of `family`; shape_overrides replace its sizes (bench/micro/arch_decode.py's larger shape)."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    shape = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                 eos_token_id=2)
    shape.update(shape_overrides)
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    if family == "llama3":
        return LlamaConfig(**shape, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)
    if family == "qwen2":
        return Qwen2Config(**shape, tie_word_embeddings=False, rope_theta=10000.0)
    if family == "qwen3":
        return Qwen3Config(**shape, head_dim=head_dim, tie_word_embeddings=True, rope_theta=10000.0)
    if family == "mistral":
        # a window wider than the context: full attention everywhere (a narrower one caps the context)
        return MistralConfig(**shape, head_dim=head_dim, sliding_window=4096, tie_word_embeddings=False,
                             rope_theta=10000.0)
    if family == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=256, n_inner=256,
                          bos_token_id=1, eos_token_id=2)
    raise ValueError(family)


FAMILIES = ("llama3", "qwen2", "mistral", "qwen3", "gpt2")


def tiny_model(family: str, seed: int = 0):
    """The transformers model of `family` with seeded, wide random weights, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name or ".ln_" in name or name.startswith("transformer.ln_f")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g)) if name.endswith("weight") else \
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model


def save_checkpoint(model, tokenizer, path: Path) -> Path:
    """`model` as safetensors in directory `path`, the tokenizer beside it."""
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


# ---- GGUF, as llama.cpp's converter lays it out ----------------------------------------------------------
def _permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's rotate-half q/k rows into llama.cpp's interleaved order (what its converter does for Llama)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(cfg) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for a llama3 rope scaling: each frequency's divisor."""
    rope = cfg.rope_parameters
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                              rope["high_freq_factor"], rope["factor"])
    out = []
    for wavelen in 2 * np.pi / inv:
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def save_gguf(model, family: str, path: Path, tokenizer_gguf: Path | None = None, matrices: str = "q8_0") -> Path:
    """`model` (llama3, qwen2 or qwen3) as a GGUF file with llama.cpp's tensor names and metadata: matrices in
    `matrices` (q8_0 or f32), vectors in f32; the tokenizer metadata of `tokenizer_gguf` (the default
    model's) when given (reading and writing its 49152 tokens and merges costs seconds, and every
    reader of the file pays again, so engine tests go without)."""
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    arch = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[family]
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_rope_dimension_count(head_dim)
    if family == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    fields = gguf.GGUFReader(str(tokenizer_gguf)).fields if tokenizer_gguf is not None else {}
    for key, field in fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), vtype, sub_type=sub)

    def put(name: str, t) -> None:
        a = np.ascontiguousarray(t.detach().float().numpy())
        if a.ndim == 2 and matrices == "q8_0":
            w.add_tensor(name, quantize(a, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)

    sd = model.state_dict()
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    if family == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg))
    for i in range(cfg.num_hidden_layers):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        for hf, ours in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
            put(f"{blk}{ours}.weight", sd[f"{pre}{hf}.weight"])
        for p, ours, n in (("q", "attn_q", heads), ("k", "attn_k", kv_heads), ("v", "attn_v", 0),
                           ("o", "attn_output", 0)):
            for kind in ("weight", "bias"):
                t = sd.get(f"{pre}self_attn.{p}_proj.{kind}")
                if t is None:
                    continue
                if n and arch == "llama":
                    t = torch_from(_permute_rope_rows(t.detach().numpy(), n))
                put(f"{blk}{ours}.{kind}", t)
        for hf, ours in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            if f"{pre}self_attn.{hf}.weight" in sd:
                put(f"{blk}{ours}.weight", sd[f"{pre}self_attn.{hf}.weight"])
        for p in ("gate", "up", "down"):
            put(f"{blk}ffn_{p}.weight", sd[f"{pre}mlp.{p}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def torch_from(a: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))
