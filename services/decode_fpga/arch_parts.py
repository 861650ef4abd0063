"""The parts an architecture adds to Llama's layer, on the OpenCL device: their vectors (ArchVectors) and
their launches (ArchKernels, kernels/arch_ops.cl).

Which parts a model has is its Architecture's (services/model/architecture.py): LayerNorm instead
of RMSNorm, biases of q|k|v, of the output projection and of the MLP, per-head q/k RMSNorm, a GELU
MLP, learned positions. The launch plans (plans.py, paged_plans.py) ask ArchKernels for a norm or an
activation and add a bias or a head norm where the vectors exist; for Llama none of these launches
is made and its plan is unchanged. These launches are one work-item per row, so a row's result
never depends on the batch (paged_plans.py's batch invariance).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyopencl as cl

from services.decode_fpga.device import DeviceContext
from services.decode_fpga.launch import Launch, bind
from services.decode_fpga.scratch import blocks32
from services.model.architecture import Architecture
from services.model.config import ModelConfig
from services.model.weights import LayerWeights, ModelWeights


def one_launch_takes(arch: Architecture) -> bool:
    """Whether the one-launch decode_layers.cl computes this architecture's layer: Llama's, with or without
    q/k/v biases (its -DQKV_BIAS) and q/k head norms (-DQK_NORM). Any other part (LayerNorm, learned
    positions, GELU, other biases) runs launch by launch."""
    return (arch.norm == "rms" and arch.positions == "rope" and arch.gated
            and not (arch.out_bias or arch.mlp_bias))


def _upload(dev: DeviceContext, *parts: np.ndarray | None) -> cl.Buffer | None:
    """The parts one after the other in one fp32 buffer; None when the architecture has none."""
    if parts[0] is None:
        return None
    host = np.ascontiguousarray(np.concatenate([np.asarray(p, np.float32) for p in parts if p is not None]))
    return cl.Buffer(dev.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)


@dataclass(frozen=True)
class LayerVectors:
    """One layer's extra vectors (None: the architecture has no such part)."""

    attn_norm_b: cl.Buffer | None  # [hidden]
    ffn_norm_b: cl.Buffer | None
    b_qkv: cl.Buffer | None  # [q_dim + 2 kv_dim]
    bo: cl.Buffer | None  # [hidden]
    q_norm: cl.Buffer | None  # [head_dim]
    k_norm: cl.Buffer | None
    b_gate_up: cl.Buffer | None  # [2 ff] gated, [ff] not
    b_down: cl.Buffer | None  # [hidden]

    @classmethod
    def upload(cls, dev: DeviceContext, w: LayerWeights) -> "LayerVectors":
        gate_up = (w.b_gate, w.b_up) if w.b_gate is not None else (w.b_up,)
        return cls(_upload(dev, w.attn_norm_b), _upload(dev, w.ffn_norm_b), _upload(dev, w.bq, w.bk, w.bv),
                   _upload(dev, w.bo), _upload(dev, w.q_norm), _upload(dev, w.k_norm), _upload(dev, *gate_up),
                   _upload(dev, w.b_down))


@dataclass(frozen=True)
class ArchVectors:
    layers: list[LayerVectors]
    final_norm_b: cl.Buffer | None  # [hidden]
    pos_embed: cl.Buffer | None  # [positions, hidden]
    # every layer's vectors one after the other, for decode_layers.cl
    qkv_bias_all: cl.Buffer | None  # [n_layers, q_dim + 2 kv_dim]: q|k|v biases
    qk_norm_all: cl.Buffer | None  # [n_layers, 2 head_dim]: q_norm | k_norm

    @classmethod
    def upload(cls, dev: DeviceContext, w: ModelWeights) -> "ArchVectors":
        first = w.layers[0]
        biases = [b for lw in w.layers for b in (lw.bq, lw.bk, lw.bv)] if first.bq is not None else [None]
        norms = [n for lw in w.layers for n in (lw.q_norm, lw.k_norm)] if first.q_norm is not None else [None]
        return cls([LayerVectors.upload(dev, lw) for lw in w.layers], _upload(dev, w.final_norm_b),
                   _upload(dev, w.pos_embed), _upload(dev, *biases), _upload(dev, *norms))

    def one_launch_defines(self) -> dict:
        """decode_layers.cl's defines for the parts it takes (one_launch_args are then its last arguments)."""
        return {**({"QKV_BIAS": 1} if self.qkv_bias_all is not None else {}),
                **({"QK_NORM": 1} if self.qk_norm_all is not None else {})}

    def one_launch_args(self) -> tuple:
        return tuple(b for b in (self.qkv_bias_all, self.qk_norm_all) if b is not None)

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads of them (the position table: one row)."""
        bufs = [b for lv in self.layers for b in vars(lv).values() if b is not None]
        return sum(b.size for b in bufs) + (self.final_norm_b.size if self.final_norm_b is not None else 0)


class ArchKernels:
    """Launches over n rows (global dimension 0 counts rows, so paged_plans.spanning makes any launch
    here follow a step's rows)."""

    def __init__(self, dev: DeviceContext, cfg: ModelConfig, elementwise: cl.Program):
        """elementwise: the plans' build of elementwise.cl (silu_mul)."""
        self.cfg = cfg
        self._norm = dev.build("norm.cl")
        self._ops = dev.build("arch_ops.cl", {"HEAD_DIM": cfg.head_dim, "Q_DIM": cfg.q_dim, "KV_DIM": cfg.kv_dim})
        self._silu = elementwise

    def norm(self, rows: cl.Buffer, w: cl.Buffer, b: cl.Buffer | None, out: cl.Buffer, out_sums: cl.Buffer,
             n: int) -> Launch:
        """The architecture's norm of rows[0:n] into out and its 32-block sums."""
        c = self.cfg
        if c.arch.norm == "layer":
            return bind(self._ops, "layer_norm", (n,), rows, w, b, out, out_sums, np.int32(c.hidden),
                        np.float32(c.rms_eps), by_row=True)
        return bind(self._norm, "rms_norm", (n,), rows, w, out, out_sums, np.int32(c.hidden), np.float32(c.rms_eps),
                    by_row=True)

    def add_bias(self, y: cl.Buffer, bias: cl.Buffer, cols: int, n: int) -> Launch:
        return bind(self._ops, "add_bias", (n,), y, bias, np.int32(cols), by_row=True)

    def head_norm(self, qkv: cl.Buffer, q_w: cl.Buffer, k_w: cl.Buffer, n: int) -> Launch:
        c = self.cfg
        return bind(self._ops, "head_rms_norm", (n, c.n_heads + c.n_kv_heads), qkv, q_w, k_w, np.float32(c.rms_eps),
                    by_row=True)

    def activation(self, gu: cl.Buffer, act: cl.Buffer, act_sums: cl.Buffer, n: int) -> Launch:
        """act = silu(gate) * up of gu = gate | up [rows, 2 ff], or gelu(up) of gu = up [rows, ff]."""
        ff = self.cfg.intermediate
        if self.cfg.arch.gated:
            return bind(self._silu, "silu_mul", (n, blocks32(ff)), gu, act, act_sums, np.int32(ff), by_row=True)
        return bind(self._ops, "gelu_rows", (n, blocks32(ff)), gu, act, act_sums, np.int32(ff), by_row=True)

    def add_positions(self, x: cl.Buffer, table: cl.Buffer, pos: cl.Buffer, n: int) -> Launch:
        return bind(self._ops, "add_positions", (n,), x, table, pos, np.int32(self.cfg.hidden), by_row=True)
