"""The launches of a forward, bound once and replayed (LaunchPlans): a prefill chunk, a decode step,
the logits and the greedy pick.

Setting a kernel's arguments costs ~40 µs in pyopencl (launch.py), so the launches
of a forward over n rows are bound once per n, to the scratch buffers, the KV
store's planes and the device weights, and replayed every step. A decode step's
plan fuses what it can, since PoCL charges a few µs per command: RoPE, the KV
write and attention in one launch, and for one row the RMSNorm inside the block
GEMVs that follow it and SiLU inside the down projection (153 commands per token
for SmolLM2, from 274). Kernels come in the device's shape: one work-item per
output row or head on a CPU or an FPGA, a work-group of lanes on a GPU
(DeviceContext.lanes_per_row/_head).

On a CPU device with packed block weights, a one-sequence decode step is one
launch for every layer (decode_layers.cl: one work-group per core, phases
separated by barriers across work-groups; 4 commands per token, the same bits):
a plan of kind ONE_LAUNCH. Both kinds are kept; the engine picks one per step (one_launch_choice.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import pyopencl as cl

from services.decode_fpga.arch_parts import ArchKernels
from services.decode_fpga.config import PREFILL_CHUNK, DeviceFit
from services.decode_fpga.device import DeviceContext
from services.decode_fpga.device_weights import DeviceWeights
from services.decode_fpga.gemv import DeviceMatrix
from services.decode_fpga.kv_store import KVStore
from services.decode_fpga.launch import Launch, bind
from services.decode_fpga.one_launch_choice import BARRIER_SPIN_LIMIT
from services.decode_fpga.scratch import SYNC_LINE, Scratch, blocks32
from services.model.config import ModelConfig

ARGMAX_WG = 256  # work-items per row of argmax_rows


class StepKind(enum.Enum):
    LAUNCH_BY_LAUNCH = "launch by launch"  # each layer's launches in turn
    ONE_LAUNCH = "one launch"  # every layer in one decode_layers launch; the host must not enqueue while it runs


@dataclass(frozen=True)
class StepPlan:
    """The embedding lookup and the layers of one forward over n rows of scratch.x."""

    kind: StepKind
    embed: Launch
    layers: list[list[Launch]]  # each layer's launches in order; ONE_LAUNCH: one entry, [clear_ints, decode_layers]


class LaunchPlans:
    def __init__(self, dev: DeviceContext, cfg: ModelConfig, weights: DeviceWeights, kv: KVStore, scratch: Scratch,
                 fit: DeviceFit):
        self.dev, self.cfg, self.weights, self.kv, self.s = dev, cfg, weights, kv, scratch
        shape = {"HEAD_DIM": cfg.head_dim, "GROUP": cfg.n_heads // cfg.n_kv_heads, "Q_DIM": cfg.q_dim,
                 "KV_DIM": cfg.kv_dim}
        self._attention = dev.build("attention.cl", shape)
        # a GPU's decode attention: a work-group per (row, head) instead of a work-item (attention_wg.cl)
        self._attention_lanes = dev.lanes_per_head
        self._attention_wg = (dev.build("attention_wg.cl", {**shape, "WG": self._attention_lanes})
                              if self._attention_lanes > 1 else None)
        self._elementwise = dev.build("elementwise.cl", {"ARGMAX_WG": ARGMAX_WG})
        self._arch = ArchKernels(dev, cfg, self._elementwise)  # the architecture's norm, activation, extras
        self.one_launch = fit.one_launch_layers and weights.packed is not None
        self.layer_groups = fit.layer_groups  # work-groups of decode_layers: one per worker thread
        self._steps: dict[tuple[int, bool, bool], StepPlan] = {}  # (rows, decode, one launch) → plan
        self._logits: dict[tuple[str, int], list[Launch]] = {}
        self._argmax: dict[int, Launch] = {}
        bind(self._attention, "rope_table", (fit.max_context, cfg.head_dim // 2), weights.inv_freq,
             scratch.rope_cs).enqueue(dev.queue)

    # ---- the plans ----------------------------------------------------------------
    def prefill_chunk(self, rows: int) -> StepPlan:
        """rows of one prompt: KV written for each, then attention over the prompt so far. Full chunks and
        decode-sized ones recur and are kept; a one-off partial chunk is bound and dropped."""
        key = (rows, False, False)
        plan = self._steps.get(key)
        if plan is None:
            plan = self._bind_step(rows, decode=False)
            if rows == PREFILL_CHUNK or rows <= self.kv.max_sequences:
                self._steps[key] = plan
        return plan

    def decode_step(self, batch: int, one_launch: bool = True) -> StepPlan:
        """One row per sequence: RoPE, the KV write and attention as one launch per layer; one row,
        one_launch asked and the device fit for it: every layer as one launch."""
        key = (batch, True, one_launch and batch == 1 and self.one_launch)
        if key not in self._steps:
            self._steps[key] = self._bind_step(batch, decode=True, one_launch=key[2])
        return self._steps[key]

    def logits(self, src: str, n: int) -> list[Launch]:
        """Final norm and LM head into scratch.logits[0:n]: of scratch.x's n rows (src "rows", a decode
        step) or of scratch.last's one row (src "last", a prefill's last token)."""
        key = (src, n)
        if key not in self._logits:
            rows = self.s.last if src == "last" else self.s.x
            self._logits[key] = self._normed_gemv(rows, self.weights.final_norm, self.weights.arch.final_norm_b,
                                                  self.weights.lm_head, self.s.logits, n, fuse=n == 1)
        return self._logits[key]

    def argmax(self, n: int) -> Launch:
        """The greedy pick of each of scratch.logits' first n rows into scratch.tokens, and scratch.pos += 1:
        the next decode step's rows, already on the device."""
        if n not in self._argmax:
            self._argmax[n] = bind(self._elementwise, "argmax_rows", (n * ARGMAX_WG,), self.s.logits,
                                   np.int32(self.cfg.vocab_size), self.s.tokens, self.s.pos, local_size=(ARGMAX_WG,))
        return self._argmax[n]

    # ---- binding --------------------------------------------------------------------
    def _bind_step(self, n: int, decode: bool, one_launch: bool = False) -> StepPlan:
        embed = self.weights.embed.bind_embed(self.s.tokens, self.s.x, n)
        if one_launch:
            # one launch for every layer, after its counters are zeroed (decode_layers.cl)
            clear = bind(self._elementwise, "clear_ints", (SYNC_LINE * (2 + 2 * self.cfg.n_layers),), self.s.sync)
            return StepPlan(StepKind.ONE_LAUNCH, embed, [[clear, self._decode_layers()]])
        layers = [self._bind_layer(li, n, decode) for li in range(self.cfg.n_layers)]
        if self.weights.arch.pos_embed is not None:  # learned positions: added before the first layer
            layers[0].insert(0, self._arch.add_positions(self.s.x, self.weights.arch.pos_embed, self.s.pos, n))
        return StepPlan(StepKind.LAUNCH_BY_LAUNCH, embed, layers)

    def _bind_layer(self, li: int, n: int, decode: bool) -> list[Launch]:
        """The launches of layer li over n rows of scratch.x, in order. decode: every row is a different
        sequence (a decode step), so RoPE, the KV write and attention are one launch; with one row,
        block-format matrices also normalize their own input (no rms_norm launches) and the down
        projection makes its own activation (no silu_mul launch). The architecture's extra parts
        (arch_parts.py) are launches of their own where its vectors exist."""
        c, s, layer, ext, ak = self.cfg, self.s, self.weights.layers[li], self.weights.arch.layers[li], self._arch
        group = c.n_heads // c.n_kv_heads
        fuse = decode and n == 1  # prologues in the GEMVs: a work-group's prologue makes one row's input
        out = self._normed_gemv(s.x, layer.attn_norm, ext.attn_norm_b, layer.qkv, s.qkv, n, fuse)
        if ext.b_qkv is not None:
            out.append(ak.add_bias(s.qkv, ext.b_qkv, c.q_dim + 2 * c.kv_dim, n))
        if ext.q_norm is not None:  # before RoPE, which the attention launches apply
            out.append(ak.head_norm(s.qkv, ext.q_norm, ext.k_norm, n))
        scale = np.float32(1.0 / np.sqrt(c.head_dim))
        # one channel: every kv head's plane at a fixed stride, so one launch covers them all
        # (two commands per layer instead of 2 x n_kv_heads; PoCL charges per command)
        one_launch = self.kv.layout.n_channels == 1
        heads = [0] if one_launch else range(c.n_kv_heads)
        span = c.n_kv_heads if one_launch else 1
        head_stride = np.int64(self.kv.layout.plane_elems)
        for h in heads:
            cache = (*self.kv.plane(li, 0, h), *self.kv.plane(li, 1, h), head_stride)
            if decode:
                args = (s.qkv, s.slots, s.pos, s.rope_cs, np.int32(h), scale, *cache, s.attn, s.attn_sums)
                if self._attention_wg is not None:
                    lanes = self._attention_lanes
                    out.append(bind(self._attention_wg, "rope_attention_decode_wg", (n * lanes, span * group),
                                    *args, local_size=(lanes, 1)))
                else:
                    out.append(bind(self._attention, "rope_attention_decode", (n, span * group), *args,
                                    local_size=(1, 1)))
                continue
            out.append(bind(self._attention, "rope_store_kv", (n, span * (group + 1)), s.qkv, s.slots, s.pos,
                            s.rope_cs, np.int32(h), *cache, by_row=True))
            out.append(bind(self._attention, "attention", (n, span * group), s.qkv, s.slots, s.pos, np.int32(h),
                            scale, *cache, s.attn, s.attn_sums, local_size=(1, 1)))
        if c.head_dim % 32 and layer.o.needs_block_sums:  # attention writes the sums only of whole blocks
            out.append(layer.o.bind_block_sums(s.attn, s.attn_sums, n))
        out.append(layer.o.bind_gemv(s.attn, s.x, n, accumulate=True, x_sums=s.attn_sums))  # residual
        if ext.bo is not None:
            out.append(ak.add_bias(s.x, ext.bo, c.hidden, n))
        out += self._normed_gemv(s.x, layer.ffn_norm, ext.ffn_norm_b, layer.gate_up, s.gu, n, fuse)
        if ext.b_gate_up is not None:
            out.append(ak.add_bias(s.gu, ext.b_gate_up, layer.gate_up.rows, n))
        elif fuse and layer.down.fuses_silu and c.arch.gated:  # the activation in the GEMV's prologue
            out.append(layer.down.bind_gemv_silu(s.gu, s.x, accumulate=True))
            return out
        out += [ak.activation(s.gu, s.act, s.act_sums, n),
                layer.down.bind_gemv(s.act, s.x, n, accumulate=True, x_sums=s.act_sums)]
        if ext.b_down is not None:
            out.append(ak.add_bias(s.x, ext.b_down, c.hidden, n))
        return out

    def _normed_gemv(self, rows, norm_w, norm_b, matrix: DeviceMatrix, y, n: int, fuse: bool) -> list[Launch]:
        """y = matrix @ norm(rows[0:n]) (the architecture's norm: norm_b its LayerNorm bias): one launch
        when fuse (one row), the norm is RMSNorm and the matrix can normalize its input itself (block
        formats: gemv_quant_norm), else the norm into scratch.xn and a GEMV."""
        c, s = self.cfg, self.s
        if fuse and matrix.fuses_norm and c.arch.norm == "rms":
            return [matrix.bind_gemv_norm(rows, norm_w, c.rms_eps, y)]
        return [self._arch.norm(rows, norm_w, norm_b, s.xn, s.xn_sums, n),
                matrix.bind_gemv(s.xn, y, n, x_sums=s.xn_sums)]

    def _decode_layers(self) -> Launch:
        """Every layer of a one-sequence decode step as one launch (decode_layers.cl)."""
        c, s, packed = self.cfg, self.s, self.weights.packed
        program = self.dev.build("decode_layers.cl", {
            "QFMT_SET": packed.qfmt_set, "HIDDEN": c.hidden, "FF": c.intermediate,
            "HEAD_DIM": c.head_dim, "GROUP": c.n_heads // c.n_kv_heads, "Q_DIM": c.q_dim, "KV_DIM": c.kv_dim,
            "XL": max(c.hidden, c.intermediate, c.q_dim), "LINE": SYNC_LINE, "SPIN_LIMIT": f"{BARRIER_SPIN_LIMIT}L",
            **self.weights.arch.one_launch_defines()})
        self._kv_bases = cl.Buffer(self.dev.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                                   hostbuf=self.kv.layer_bases())
        channel, _, slot_stride = self.kv.plane(0, 0, 0)
        return bind(program, "decode_layers", (self.layer_groups,), s.x, packed.arrays.buffer, packed.table,
                    self._kv_bases, np.int32(c.n_layers), np.float32(c.rms_eps), s.qkv, s.attn, s.attn_sums, s.gu,
                    s.act, s.act_sums, s.slots, s.pos, s.rope_cs, np.float32(1.0 / np.sqrt(c.head_dim)), channel,
                    slot_stride, np.int64(self.kv.layout.plane_elems), s.sync, *self.weights.arch.one_launch_args(),
                    local_size=(1,))
