"""A Llama-family forward in PyTorch with an explicit per-sequence KV cache.

The cache of one sequence is `k, v: [n_layers, n_kv_heads, capacity, head_dim]`,
so `k[l, :, :n]` is exactly layer l's K in the wire layout (services/kv/layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from services.model.config import ModelConfig
from services.model.weights import ModelWeights


@dataclass
class TorchSequence:
    """KV cache of one sequence and how many of its positions are filled."""

    k: torch.Tensor  # [n_layers, n_kv_heads, capacity, head_dim]
    v: torch.Tensor
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


@dataclass(frozen=True)
class TorchLayer:
    attn_norm: torch.Tensor
    # Matrices are stored transposed, [in, out]: MKL's GEMV reads that layout
    # ~2.5x faster than x @ W.T here (17.9 vs 7 GB/s for the LM head).
    w_qkv: torch.Tensor  # [hidden, q_dim + 2 kv_dim]: one matmul instead of three
    wo: torch.Tensor  # [q_dim, hidden]
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [hidden, 2 intermediate]
    w_down: torch.Tensor  # [intermediate, hidden]


class LlamaTorch:
    """The model's parameters on one device and the two forwards: prefill and batched decode."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: torch.device, dtype: torch.dtype):
        self.cfg, self.device, self.dtype = cfg, device, dtype

        def t(a):
            return torch.tensor(a, device=device, dtype=dtype)

        def t_in_out(*mats):  # stack along out, store as [in, out]
            return torch.cat([t(m) for m in mats]).T.contiguous()

        self.embed = t(weights.embed)  # [vocab, hidden], for row lookups
        self.lm_head_t = t_in_out(weights.lm_head)  # [hidden, vocab]
        self.final_norm = t(weights.final_norm)
        self.layers = [
            TorchLayer(
                attn_norm=t(w.attn_norm),
                w_qkv=t_in_out(w.wq, w.wk, w.wv),
                wo=t_in_out(w.wo),
                ffn_norm=t(w.ffn_norm),
                w_gate_up=t_in_out(w.w_gate, w.w_up),
                w_down=t_in_out(w.w_down),
            )
            for w in weights.layers
        ]
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
        self.inv_freq = inv_freq.to(device)

    def new_sequence(self, capacity: int) -> TorchSequence:
        c = self.cfg
        shape = (c.n_layers, c.n_kv_heads, capacity, c.head_dim)
        return TorchSequence(torch.empty(shape, device=self.device, dtype=self.dtype),
                             torch.empty(shape, device=self.device, dtype=self.dtype))

    # ---- building blocks -------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)
        return w * x32.to(self.dtype)

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # computed once per forward and shared by every layer; [T, 1, dim] each
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    @staticmethod
    def _rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [T, heads, dim]
        cos, sin = rope
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, layer: TorchLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        c = self.cfg
        qkv = self._rms_norm(x, layer.attn_norm) @ layer.w_qkv  # [T, q_dim + 2 kv_dim]
        q, k, v = qkv.split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        q = self._rope(q.view(-1, c.n_heads, c.head_dim), rope)
        k = self._rope(k.view(-1, c.n_kv_heads, c.head_dim), rope)
        return q, k, v.view(-1, c.n_kv_heads, c.head_dim)

    def _mlp_residual(self, layer: TorchLayer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + attn @ layer.wo
        gate, up = (self._rms_norm(x, layer.ffn_norm) @ layer.w_gate_up).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ layer.w_down

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self._rms_norm(x, self.final_norm) @ self.lm_head_t).float()

    # ---- forwards --------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq: TorchSequence, token_ids: list[int],
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run the prompt through the model into an empty cache; logits of the last position [vocab].

        `on_layer(l)` is called as soon as layer l's K/V are in the cache, so a
        caller can ship that layer while the next one computes.
        """
        if seq.length != 0:
            raise ValueError("prefill starts from an empty cache")
        n = len(token_ids)
        if not 0 < n <= seq.capacity:
            raise ValueError(f"prompt of {n} tokens does not fit capacity {seq.capacity}")
        ids = torch.tensor(token_ids, device=self.device)
        rope = self._rope_tables(torch.arange(n, device=self.device))
        x = self.embed[ids]  # [T, hidden]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rope)
            seq.k[li, :, :n] = k.transpose(0, 1)
            seq.v[li, :, :n] = v.transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], seq.k[li, :, :n][None], seq.v[li, :, :n][None],
                is_causal=True, enable_gqa=True,
            )  # [1, heads, T, dim]
            x = self._mlp_residual(layer, x, attn[0].transpose(0, 1).reshape(n, -1))
            if on_layer is not None:
                on_layer(li)
        seq.length = n
        return self._logits(x[-1])

    @torch.inference_mode()
    def decode(self, seqs: list[TorchSequence], tokens: list[int]) -> torch.Tensor:
        """One step for a batch of sequences of any lengths; logits [B, vocab]."""
        if not seqs or len(seqs) != len(tokens):
            raise ValueError(f"a decode step of {len(seqs)} sequences and {len(tokens)} tokens")
        for s in seqs:
            if s.length >= s.capacity:
                raise ValueError("sequence is full")
        rope = self._rope_tables(torch.tensor([s.length for s in seqs], device=self.device))
        x = self.embed[torch.tensor(tokens, device=self.device)]  # [B, hidden]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rope)  # q [B, heads, dim]; k, v [B, kv_heads, dim]
            outs = []
            for b, s in enumerate(seqs):
                n = s.length
                s.k[li, :, n] = k[b]
                s.v[li, :, n] = v[b]
                # one query attends to every cached position: no mask needed
                o = F.scaled_dot_product_attention(
                    q[b][None, :, None], s.k[li, :, : n + 1][None], s.v[li, :, : n + 1][None], enable_gqa=True
                )
                outs.append(o.reshape(1, -1))
            x = self._mlp_residual(layer, x, torch.cat(outs))
        for s in seqs:
            s.length += 1
        return self._logits(x)
