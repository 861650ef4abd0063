"""A decoder-only transformer's parameters and parts in PyTorch, which the paged step
(batched_step.py) runs over the rows of a step and the KV pool (kv_pool.py).

The architecture (services/model/architecture.py) switches its parts: RMSNorm or LayerNorm,
RoPE (its frequencies from the config, scaling applied) or learned positions, the biases, the
per-head q/k RMSNorm, a gated SiLU or a GELU MLP. Each part computes what transformers' module
of that family computes, in the same order of operations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from services.model.config import ModelConfig
from services.model.weights import ModelWeights


@dataclass(frozen=True)
class TorchLayer:
    attn_norm: torch.Tensor
    # Matrices are stored transposed, [in, out]: MKL's GEMV reads that layout
    # ~2.5x faster than x @ W.T here (17.9 vs 7 GB/s for the LM head).
    # (`out_in`: [out, in] each, the checkpoint's own layout, which cuBLAS reads faster at a few rows)
    w_qkv: torch.Tensor  # [hidden, q_dim + 2 kv_dim]: one matmul instead of three
    wo: torch.Tensor  # [q_dim, hidden]
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [hidden, 2 intermediate] (gated MLP) or [hidden, intermediate] (up only)
    w_down: torch.Tensor  # [intermediate, hidden]
    # None where the architecture has no such tensor
    attn_norm_b: torch.Tensor | None = None
    ffn_norm_b: torch.Tensor | None = None
    b_qkv: torch.Tensor | None = None  # [q_dim + 2 kv_dim]
    bo: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None


class LlamaTorch:
    """The model's parameters on one device and the parts of its forward (batched_step.run_step runs them).

    `out_in`: matrices kept [out, in] and applied as x @ W.T (F.linear), the layout measured faster
    with cuBLAS at a few rows (bench/micro/gpu_engine.py); the CPU keeps [in, out], MKL's faster one.

    `fused`: fewer kernels per layer (torch's fused RMSNorm, the residual adds inside the GEMMs
    of `wo` and `w_down`), for a GPU where a small model's step is bound by how many kernels it
    runs. Not the bits of transformers' separate operations: the norm sums in another order and a
    GEMM's epilogue adds the residual, so logits agree to rounding, not to the bit (measured:
    bench/micro/gpu_engine.py). Off by default: on the CPU every step keeps transformers' order of
    operations, which its parity and batch-invariance tests check bit for bit.
    """

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: torch.device, dtype: torch.dtype,
                 fused: bool = False, out_in: bool = False):
        self.cfg, self.device, self.dtype, self.fused, self.out_in = cfg, device, dtype, fused, out_in

        def t(a):
            return torch.tensor(a, device=device, dtype=dtype)

        def t_in_out(*mats):  # stack along out; stored [in, out], or as given ([out, in]) when out_in
            stacked = torch.cat([t(m) for m in mats])
            return stacked if out_in else stacked.T.contiguous()

        def opt(*arrays):  # one vector of the parts, or None when the architecture has none
            return None if arrays[0] is None else torch.cat([t(a) for a in arrays])

        self.arch = cfg.arch
        self.embed = t(weights.embed)  # [vocab, hidden], for row lookups
        self.pos_embed = None if weights.pos_embed is None else t(weights.pos_embed)  # [positions, hidden]
        # [hidden, vocab] in either layout: cuBLAS too reads the head faster so (H100, gemm_us in
        # bench/results/engine_gpu.json: 39 against 43 us at one row, 95 against 109 at 64)
        self.lm_head_t = t(weights.lm_head).T.contiguous()
        self.final_norm = t(weights.final_norm)
        self.final_norm_b = opt(weights.final_norm_b)
        self.layers = [
            TorchLayer(
                attn_norm=t(w.attn_norm),
                w_qkv=t_in_out(w.wq, w.wk, w.wv),
                wo=t_in_out(w.wo),
                ffn_norm=t(w.ffn_norm),
                w_gate_up=t_in_out(*([w.w_gate] if w.w_gate is not None else []), w.w_up),
                w_down=t_in_out(w.w_down),
                attn_norm_b=opt(w.attn_norm_b), ffn_norm_b=opt(w.ffn_norm_b), b_qkv=opt(w.bq, w.bk, w.bv),
                bo=opt(w.bo), q_norm=opt(w.q_norm), k_norm=opt(w.k_norm),
                b_gate_up=opt(*([w.b_gate] if w.b_gate is not None else []), w.b_up), b_down=opt(w.b_down),
            )
            for w in weights.layers
        ]
        self.inv_freq = torch.from_numpy(cfg.inv_freq()).to(device)  # the same table the OpenCL engine uses

    # ---- building blocks -------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.fused:  # one kernel instead of six
            return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)
        return w * x32.to(self.dtype)

    def _norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The architecture's norm: RMSNorm, or LayerNorm (weight and bias)."""
        if self.arch.norm == "layer":
            return F.layer_norm(x, (x.shape[-1],), w, b, self.cfg.rms_eps)
        return self._rms_norm(x, w)

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings, plus the learned position embeddings where the architecture has them."""
        x = self.embed[ids]
        return x if self.pos_embed is None else x + self.pos_embed[positions]

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if self.out_in:
            return F.linear(x, w, b)
        return x @ w if b is None else torch.addmm(b, x, w)

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sin of every row's position, [T, 1, dim] each; shared by every layer.

        transformers rotates x into cat(-x2, x1) and multiplies by sin; here x is rolled into
        cat(x2, x1) and the first half of sin negated: (-a) * b and a * (-b) are the same float,
        and a roll is one kernel where negating half and concatenating are two."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin()
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        return emb.cos().to(self.dtype)[:, None, :], sin.to(self.dtype)[:, None, :]

    @staticmethod
    def _rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [T, heads, dim]
        cos, signed_sin = rope
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

    def _qkv(self, layer: TorchLayer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        c = self.cfg
        qkv = self._linear(self._norm(x, layer.attn_norm, layer.attn_norm_b), layer.w_qkv, layer.b_qkv)
        v = qkv[:, c.q_dim + c.kv_dim:].reshape(-1, c.n_kv_heads, c.head_dim)
        if self.arch.positions == "rope" and layer.q_norm is None:  # q and k rotated together: half the kernels
            qk = self._rope(qkv[:, :c.q_dim + c.kv_dim].reshape(-1, c.n_heads + c.n_kv_heads, c.head_dim), rope)
            q, k = qk.split([c.n_heads, c.n_kv_heads], dim=1)
            return q, k, v
        q, k = qkv[:, :c.q_dim].reshape(-1, c.n_heads, c.head_dim), qkv[:, c.q_dim:c.q_dim + c.kv_dim].reshape(
            -1, c.n_kv_heads, c.head_dim)
        if layer.q_norm is not None:  # per-head RMSNorm before RoPE (Qwen3)
            q, k = self._rms_norm(q, layer.q_norm), self._rms_norm(k, layer.k_norm)
        if self.arch.positions == "rope":
            q, k = self._rope(q, rope), self._rope(k, rope)
        return q, k, v

    def _residual_linear(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor,
                         b: torch.Tensor | None) -> torch.Tensor:
        """x + a's product with w (+ b): fused, the add in the GEMM's epilogue (one kernel, not two)."""
        if self.fused and b is None:
            return torch.addmm(x, a, w.T if self.out_in else w)
        return x + self._linear(a, w, b)

    def _mlp_residual(self, layer: TorchLayer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = self._residual_linear(x, attn, layer.wo, layer.bo)
        h = self._linear(self._norm(x, layer.ffn_norm, layer.ffn_norm_b), layer.w_gate_up, layer.b_gate_up)
        if self.arch.gated:
            gate, up = h.chunk(2, dim=-1)
            act = F.silu(gate) * up
        else:
            act = F.gelu(h, approximate="tanh")
        return self._residual_linear(x, act, layer.w_down, layer.b_down)

    def row_products(self) -> tuple[list[tuple[Callable[[torch.Tensor], torch.Tensor], int]], tuple]:
        """Each matrix product of a step as the step applies it (layer 0's and the LM head's), with its
        input width, and what their bits depend on (shapes, dtype, layout, bias, fusing): the matmuls
        whose batch invariance cpu_matmul.invariant_floor checks. A residual product adds a residual
        drawn from its own row (its first input), so a row's result is its own wherever it sits."""
        layer = self.layers[0]

        def width(w: torch.Tensor) -> int:
            return w.shape[1] if self.out_in else w.shape[0]

        def linear(w, b):
            return lambda x: self._linear(x, w, b)

        def residual(w, b):
            out = w.shape[0] if self.out_in else w.shape[1]
            return lambda a: self._residual_linear(a[:, :1].expand(-1, out).contiguous(), a, w, b)

        products = [(linear(layer.w_qkv, layer.b_qkv), width(layer.w_qkv)),
                    (residual(layer.wo, layer.bo), width(layer.wo)),
                    (linear(layer.w_gate_up, layer.b_gate_up), width(layer.w_gate_up)),
                    (residual(layer.w_down, layer.b_down), width(layer.w_down)),
                    (lambda x: x @ self.lm_head_t, self.lm_head_t.shape[0])]
        key = (str(self.dtype), self.out_in, self.fused,
               tuple((tuple(w.shape), b is not None) for w, b in ((layer.w_qkv, layer.b_qkv), (layer.wo, layer.bo),
                                                                 (layer.w_gate_up, layer.b_gate_up),
                                                                 (layer.w_down, layer.b_down),
                                                                 (self.lm_head_t, None))))
        return products, key

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self._norm(x, self.final_norm, self.final_norm_b) @ self.lm_head_t).float()
