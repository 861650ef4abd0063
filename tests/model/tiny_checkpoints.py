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


def family_config(family: str):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    shape = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                 eos_token_id=2)
    if family == "llama3":
        return LlamaConfig(**shape, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)
    if family == "qwen2":
        return Qwen2Config(**shape, tie_word_embeddings=False, rope_theta=10000.0)
    if family == "qwen3":
        return Qwen3Config(**shape, head_dim=32, tie_word_embeddings=True, rope_theta=10000.0)
    if family == "mistral":
        # a window wider than the context: full attention everywhere (a narrower one caps the context)
        return MistralConfig(**shape, head_dim=32, sliding_window=4096, tie_word_embeddings=False, rope_theta=10000.0)
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
