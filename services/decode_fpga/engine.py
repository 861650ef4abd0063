"""The OpenCL engine: weights resident in device buffers, KV cache across memory channels.

One forward serves prefill and decode: it runs a set of *rows* (token, slot,
position) through every layer. A prefill is the prompt's rows in chunks; a
decode step is one row per sequence. The whole step is enqueued on one in-order
queue and the host waits once, when it reads back the sampled tokens or logits
(on PoCL a waited launch costs ~48 µs, an enqueue ~2.4 µs).

The launches of a forward over n rows are bound once (launch.py: setting a
kernel's arguments costs ~40 µs in pyopencl) and replayed every step; only the
rows' token ids, slots and positions are uploaded, and only when the device does
not hold them already (a greedy step leaves the next step's there). A decode
step's plan fuses what it can, since PoCL charges a few µs per command: RoPE,
the KV write and attention in one launch, and for one row the RMSNorm inside the
block GEMVs that follow it and SiLU inside the down projection (153 commands per
token for SmolLM2, from 274).
Kernels come in the device's shape: one work-item per output row or head on a
CPU or an FPGA, a work-group of lanes on a GPU (DeviceContext.lanes_per_row/_head).

On a CPU device with block-format (gguf) weights, a one-sequence step runs every
layer in one launch (decode_layers.cl: one work-group per core, phases separated
by barriers across work-groups; 4 commands per token, the same bits), the whole
step enqueued behind a user event before it starts. If that launch's work-groups
ever fail to run at once, the step is redone launch by launch and the engine
stays there.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pyopencl as cl

from services.decode_fpga.cpu_wake import CpuWakeLatency
from services.decode_fpga.device import DeviceContext, select_device
from services.decode_fpga.gemv import DeviceMatrix, upload_dense_matrix
from services.decode_fpga.kv_channels import ChannelLayout
from services.decode_fpga.launch import Launch, bind
from services.decode_fpga.packed_arrays import PackedArrays
from services.decode_fpga.quant_gemv import QFMT_CODES, QuantMatrix, split_blocks, upload_block_matrix
from services.decode_fpga.settings import DecodeSettings
from services.engine.api import EngineFull
from services.model.config import ModelConfig
from services.model.loading import LoadedModel
from services.model.weights import ModelWeights

log = logging.getLogger(__name__)

PREFILL_CHUNK = 128  # prompt rows per forward: bounds the scratch buffers
ARGMAX_WG = 256
SYNC_LINE = 16  # decode_layers.cl's counters are SYNC_LINE ints apart (a cache line each)
MF = cl.mem_flags


def _blocks(cols: int) -> int:
    """32-column blocks of a row (the last may be short)."""
    return (cols + 31) // 32


@dataclass
class OpenCLSequence:
    slot: int
    capacity: int
    length: int = 0
    _keep_alive: list = field(default_factory=list)  # host arrays of non-blocking uploads


@dataclass(frozen=True)
class _Layer:
    attn_norm: cl.Buffer
    ffn_norm: cl.Buffer
    qkv: DeviceMatrix  # [q_dim + 2 kv_dim, hidden]
    o: DeviceMatrix  # [hidden, q_dim]
    gate_up: DeviceMatrix  # [2 ff, hidden]
    down: DeviceMatrix  # [hidden, ff]


class OpenCLEngine:
    """Engine (engine_api.py) on an OpenCL device."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, dev: DeviceContext, weights_dtype: str = "fp32",
                 kv_channels: int = 1, max_context: int = 4096, max_sequences: int = 4,
                 blocks: dict | None = None, keep_cores_awake: bool = True, layer_kernels: bool = True):
        if cfg.hidden % 16 or cfg.intermediate % 16 or cfg.head_dim % 4:
            raise ValueError("the OpenCL kernels need hidden and intermediate sizes divisible by 16")
        self.cfg, self.dev, self.weights_dtype = cfg, dev, weights_dtype
        self.device_name = dev.name
        self.max_context = min(max_context, cfg.max_context)
        self.max_sequences = max_sequences
        self._lock = threading.RLock()
        self._free_slots = list(range(max_sequences))
        # on a CPU device, cores that halt between kernels wake late for the next one (cpu_wake.py)
        self._wake = CpuWakeLatency() if keep_cores_awake and dev.device.type & cl.device_type.CPU else None
        # a one-sequence decode step's layers as one launch on a CPU device (decode_layers.cl)
        self._layer_kernels = bool(layer_kernels and dev.device.type & cl.device_type.CPU and dev.lanes_per_row == 1
                                   and kv_channels == 1 and not (cfg.hidden % 32 or cfg.intermediate % 32
                                                                 or cfg.q_dim % 32 or cfg.head_dim % 32))
        self._layer_groups = dev.device.max_compute_units  # one work-group per worker thread
        self._packed: PackedArrays | None = None  # every layer's weights in one buffer, when it runs
        start = time.perf_counter()
        if weights_dtype == "gguf":
            if blocks is None:
                raise ValueError("weights_dtype gguf needs the checkpoint's blocks (gguf_blocks.read_block_tensors)")
            self._upload_block_weights(weights, blocks)
        else:
            self._upload_weights(weights, weights_dtype)
        self.kv = ChannelLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, self.max_context, max_sequences,
                                kv_channels)
        self._channels = [cl.Buffer(dev.context, MF.READ_WRITE, max(4, self.kv.channel_elems(c) * 4))
                          for c in range(kv_channels)]
        self._build_kernels()
        self._alloc_scratch(max(PREFILL_CHUNK, max_sequences))
        self.rope_cs = cl.Buffer(dev.context, MF.READ_WRITE, self.max_context * cfg.head_dim * 4)
        bind(self._p_attn, "rope_table", (self.max_context, cfg.head_dim // 2), self.inv_freq,
             self.rope_cs).enqueue(dev.queue)
        dev.queue.finish()
        kv_bytes = sum(self.kv.channel_elems(c) * 4 for c in range(kv_channels))
        log.info("OpenCL engine on %s: %.1f MB of %s weights resident, %.1f MB KV over %d channel(s), "
                 "uploaded in %.2fs", dev.name, self.weights_nbytes / 1e6, weights_dtype, kv_bytes / 1e6,
                 kv_channels, time.perf_counter() - start)

    @classmethod
    def from_settings(cls, loaded: LoadedModel, settings: DecodeSettings) -> "OpenCLEngine":
        dev = select_device(settings.opencl_platform, settings.opencl_device, settings.opencl_binary_dir,
                            settings.opencl_lanes)
        fmt = settings.weights_dtype
        if fmt == "auto":  # the checkpoint's own blocks when it has them: same values, a fifth of the bytes
            fmt = "gguf" if loaded.checkpoint.kind == "gguf" else "fp32"
        blocks = None
        if fmt == "gguf":
            from services.model.gguf_blocks import read_block_tensors

            blocks = read_block_tensors(loaded.checkpoint, loaded.config)
        return cls(loaded.config, loaded.weights, dev, fmt, settings.kv_channels, settings.max_context,
                   settings.max_sequences, blocks, settings.opencl_keep_cores_awake, settings.opencl_layer_kernels)

    # ---- set-up -----------------------------------------------------------
    def _vec(self, a: np.ndarray) -> cl.Buffer:
        return cl.Buffer(self.dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a, np.float32))

    def _upload_common(self, w: ModelWeights) -> None:
        """What every storage format keeps in fp32: the final norm and the RoPE frequencies."""
        c = self.cfg
        self.final_norm = self._vec(w.final_norm)
        # computed as torch does (int64 arange → float32) so the angles match the reference bit for bit
        self.inv_freq = self._vec(1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.int64)
                                                          .astype(np.float32) / c.head_dim)))
        self._count_bytes()

    def _upload_weights(self, w: ModelWeights, fmt: str) -> None:
        vec = self._vec
        self.layers = [
            _Layer(attn_norm=vec(lw.attn_norm), ffn_norm=vec(lw.ffn_norm),
                   qkv=upload_dense_matrix(self.dev, np.concatenate([lw.wq, lw.wk, lw.wv]), fmt),
                   o=upload_dense_matrix(self.dev, lw.wo, fmt),
                   gate_up=upload_dense_matrix(self.dev, np.concatenate([lw.w_gate, lw.w_up]), fmt),
                   down=upload_dense_matrix(self.dev, lw.w_down, fmt))
            for lw in w.layers
        ]
        self.embed = upload_dense_matrix(self.dev, w.embed, fmt)
        self.lm_head = self.embed if w.lm_head is w.embed else upload_dense_matrix(self.dev, w.lm_head, fmt)
        self._upload_common(w)

    def _count_bytes(self) -> None:
        """Bytes a decode step reads: every layer matrix, the LM head, the norms (not the lookup table)."""
        c = self.cfg
        mats = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.weights_nbytes = sum(m.nbytes for m in mats) + self.lm_head.nbytes + (2 * c.n_layers + 1) * c.hidden * 4

    def _upload_block_weights(self, w: ModelWeights, blocks: dict) -> None:
        """Layer matrices and the LM head as the checkpoint's GGUF blocks (quant_gemv.py); on a CPU
        device whose layers all share one block format, packed into one buffer for decode_layers."""
        from services.model.gguf_blocks import stack_rows

        def tensor(i, *names):
            parts = [blocks[f"blk.{i}.{n}.weight"] for n in names]
            try:
                return parts[0] if len(parts) == 1 else stack_rows(names[0], parts)
            except ValueError as exc:  # mixed formats in one stack: keep that one exact, dense fp32
                log.warning("layer %d %s: %s; storing it as fp32", i, names, exc)
                return np.concatenate([p.dequantize() for p in parts])

        names = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
                 "down": ("ffn_down",)}
        tensors = [{k: tensor(i, *n) for k, n in names.items()} for i in range(len(w.layers))]
        fmts = {getattr(t, "qtype", None) for ts in tensors for t in ts.values()}
        if self._layer_kernels and len(fmts) == 1 and fmts <= set(QFMT_CODES):
            self.layers = self._pack_layers(w, tensors)
            self._upload_lm_head(w, blocks)
            return
        vec = self._vec

        def mat(t):
            return upload_block_matrix(self.dev, t) if not isinstance(t, np.ndarray) else \
                upload_dense_matrix(self.dev, t, "fp32")

        self.layers = [_Layer(attn_norm=vec(lw.attn_norm), ffn_norm=vec(lw.ffn_norm),
                              **{k: mat(t) for k, t in ts.items()}) for lw, ts in zip(w.layers, tensors)]
        self._upload_lm_head(w, blocks)

    def _pack_layers(self, w: ModelWeights, tensors: list[dict]) -> list[_Layer]:
        """Every layer's norms and block arrays in one buffer (packed_arrays.py), in the order of
        decode_layers.cl's table; the _Layer matrices are sub-buffers of the same memory."""
        arrays, order = [], ("qkv", "o", "gate_up", "down")
        splits = [{k: split_blocks(ts[k]) for k in order} for ts in tensors]  # once: packed, then measured
        for lw, split in zip(w.layers, splits):
            arrays += [np.ascontiguousarray(lw.attn_norm, np.float32), np.ascontiguousarray(lw.ffn_norm, np.float32)]
            for k in order:
                d, m, q = split[k]
                arrays += [d, m if m is not None else d[:, :0], q]  # an empty stand-in where there are no minimums
        self._packed = packed = PackedArrays(self.dev, arrays)
        per = 2 + 3 * len(order)
        table = np.array(packed.offsets, np.int64).reshape(len(w.layers), per)
        if table.max() >= 2 ** 31:
            raise ValueError("the packed layer weights exceed 2 GB; decode_layers indexes them with int")
        self._layer_table = cl.Buffer(self.dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=table.astype(np.int32))
        self._packed_fmt = tensors[0]["qkv"].qtype
        layers = []
        for li, ts in enumerate(tensors):
            views = packed.views[li * per:(li + 1) * per]
            mats = {}
            for j, k in enumerate(order):
                d_buf, m_buf, q_buf = views[2 + 3 * j:5 + 3 * j]
                mats[k] = QuantMatrix(self.dev, ts[k], (d_buf, m_buf if ts[k].qtype == "q4_1" else None, q_buf),
                                      split=splits[li][k])
            layers.append(_Layer(attn_norm=views[0], ffn_norm=views[1], **mats))
        return layers

    def _upload_lm_head(self, w: ModelWeights, blocks: dict) -> None:
        self.lm_head = upload_block_matrix(self.dev, blocks.get("output.weight", blocks["token_embd.weight"]))
        if w.lm_head is w.embed and hasattr(self.lm_head, "enqueue_embed"):
            self.embed = self.lm_head  # tied: rows are looked up from the same blocks, gguf's values exactly
        else:
            self.embed = upload_dense_matrix(self.dev, w.embed, "fp32")  # row lookups only: one row per token
        self._upload_common(w)

    def _build_kernels(self) -> None:
        c = self.cfg
        shape = {"HEAD_DIM": c.head_dim, "GROUP": c.n_heads // c.n_kv_heads, "Q_DIM": c.q_dim, "KV_DIM": c.kv_dim}
        self._p_attn = self.dev.build("attention.cl", shape)
        # a GPU's decode attention: a work-group per (row, head) instead of a work-item (attention_wg.cl)
        self._attn_lanes = self.dev.lanes_per_head
        self._p_attn_wg = (self.dev.build("attention_wg.cl", {**shape, "WG": self._attn_lanes})
                           if self._attn_lanes > 1 else None)
        self._p_norm = self.dev.build("norm.cl")
        self._p_elem = self.dev.build("elementwise.cl", {"ARGMAX_WG": ARGMAX_WG})
        self._layer_plans: dict[tuple[int, bool], tuple[Launch, list[list[Launch]]]] = {}
        self._logits_plans: dict[tuple[str, int], list[Launch]] = {}
        self._argmax_launches: dict[int, Launch] = {}

    def _alloc_scratch(self, rows: int) -> None:
        c, ctx = self.cfg, self.dev.context

        def buf(n, dtype=np.float32):
            return cl.Buffer(ctx, MF.READ_WRITE, n * np.dtype(dtype).itemsize)

        self.max_rows = rows
        self.b_tokens, self.b_slots, self.b_pos = buf(rows, np.int32), buf(rows, np.int32), buf(rows, np.int32)
        self._rows_on_device: tuple | None = None  # (tokens, slots, positions) the three hold
        self.b_x, self.b_xn = buf(rows * c.hidden), buf(rows * c.hidden)
        self.b_qkv, self.b_attn = buf(rows * (c.q_dim + 2 * c.kv_dim)), buf(rows * c.q_dim)
        self.b_gu, self.b_act = buf(rows * 2 * c.intermediate), buf(rows * c.intermediate)
        # the sums of b_xn, b_attn and b_act over 32-column blocks, written beside them (Q4_1 GEMVs read them)
        self.b_xn_sums, self.b_attn_sums = buf(rows * _blocks(c.hidden)), buf(rows * _blocks(c.q_dim))
        self.b_act_sums = buf(rows * _blocks(c.intermediate))
        self.b_logits = buf(self.max_sequences * c.vocab_size)
        self.b_last = buf(c.hidden)  # a prefill's last row, for its logits
        # decode_layers' failure flag, barrier arrivals and each layer's two work counters
        self.b_sync = buf(SYNC_LINE * (2 + 2 * c.n_layers), np.int32)

    # ---- the forward --------------------------------------------------------
    def _plane(self, layer: int, kv: int, head: int) -> tuple[cl.Buffer, np.int64, np.int64]:
        ch, base = self.kv.locate(0, layer, kv, head)
        _, slot1 = self.kv.locate(1, layer, kv, head) if self.kv.n_slots > 1 else (ch, base)
        return self._channels[ch], np.int64(base), np.int64(slot1 - base)

    def _enqueue_rows(self, tokens, slots, pos, keep: list) -> None:
        """Upload the rows' token ids, slots and positions (sequences of ints; keep holds the host
        arrays), unless the device holds them already: a greedy step leaves its picks and next
        positions (argmax_rows)."""
        rows = (tuple(tokens), tuple(slots), tuple(pos))
        if rows == self._rows_on_device:
            return
        for b, a in zip((self.b_tokens, self.b_slots, self.b_pos), rows):
            a = np.array(a, np.int32)
            keep.append(a)
            cl.enqueue_copy(self.dev.queue, b, a, is_blocking=False)
        self._rows_on_device = rows

    def _bind_layer(self, li: int, n: int, decode: bool) -> list[Launch]:
        """The launches of layer li over n rows of b_x, in order. decode: every row is a different
        sequence (a decode step), so RoPE, the KV write and attention are one launch; with one row,
        block-format matrices also normalize their own input (no rms_norm launches) and the down
        projection makes its own activation (no silu_mul launch)."""
        c, layer = self.cfg, self.layers[li]
        group = c.n_heads // c.n_kv_heads
        fuse = decode and n == 1  # prologues in the GEMVs: a work-group's prologue makes one row's input
        out = self._normed_gemv(self.b_x, layer.attn_norm, layer.qkv, self.b_qkv, n, fuse)
        scale = np.float32(1.0 / np.sqrt(c.head_dim))
        # one channel: every kv head's plane at a fixed stride, so one launch covers them all
        # (two commands per layer instead of 2 x n_kv_heads; PoCL charges per command)
        one_launch = self.kv.n_channels == 1
        heads = [0] if one_launch else range(c.n_kv_heads)
        span = c.n_kv_heads if one_launch else 1
        head_stride = np.int64(self.kv.plane_elems)
        for h in heads:
            k_buf, k_base, k_stride = self._plane(li, 0, h)
            v_buf, v_base, v_stride = self._plane(li, 1, h)
            cache = (k_buf, k_base, k_stride, v_buf, v_base, v_stride, head_stride)
            if decode:
                args = (self.b_qkv, self.b_slots, self.b_pos, self.rope_cs, np.int32(h), scale, *cache, self.b_attn,
                        self.b_attn_sums)
                if self._p_attn_wg is not None:
                    lanes = self._attn_lanes
                    out.append(bind(self._p_attn_wg, "rope_attention_decode_wg", (n * lanes, span * group), *args,
                                    local_size=(lanes, 1)))
                else:
                    out.append(bind(self._p_attn, "rope_attention_decode", (n, span * group), *args,
                                    local_size=(1, 1)))
                continue
            out.append(bind(self._p_attn, "rope_store_kv", (n, span * (group + 1)), self.b_qkv, self.b_slots,
                            self.b_pos, self.rope_cs, np.int32(h), *cache))
            out.append(bind(self._p_attn, "attention", (n, span * group), self.b_qkv, self.b_slots, self.b_pos,
                            np.int32(h), scale, *cache, self.b_attn, self.b_attn_sums, local_size=(1, 1)))
        if c.head_dim % 32 and layer.o.needs_block_sums:  # attention writes the sums only of whole blocks
            out.append(layer.o.bind_block_sums(self.b_attn, self.b_attn_sums, n))
        out.append(layer.o.bind_gemv(self.b_attn, self.b_x, n, accumulate=True, x_sums=self.b_attn_sums))  # residual
        out += self._normed_gemv(self.b_x, layer.ffn_norm, layer.gate_up, self.b_gu, n, fuse)
        if fuse and getattr(layer.down, "fuses_silu", False):  # the activation in the GEMV's prologue
            out.append(layer.down.bind_gemv_silu(self.b_gu, self.b_x, accumulate=True))
            return out
        out += [bind(self._p_elem, "silu_mul", (n, _blocks(c.intermediate)), self.b_gu, self.b_act, self.b_act_sums,
                     np.int32(c.intermediate)),
                layer.down.bind_gemv(self.b_act, self.b_x, n, accumulate=True, x_sums=self.b_act_sums)]
        return out

    def _decode_layers_launch(self) -> Launch:
        """Every layer of a one-sequence decode step as one launch (decode_layers.cl)."""
        c = self.cfg
        program = self.dev.build("decode_layers.cl", {
            "QFMT": QFMT_CODES[self._packed_fmt], "HIDDEN": c.hidden, "FF": c.intermediate,
            "HEAD_DIM": c.head_dim, "GROUP": c.n_heads // c.n_kv_heads, "Q_DIM": c.q_dim, "KV_DIM": c.kv_dim,
            "XL": max(c.hidden, c.intermediate, c.q_dim), "LINE": SYNC_LINE})
        bases = np.array([[self._plane(li, kv, 0)[1] for kv in (0, 1)] for li in range(c.n_layers)], np.int64)
        self._kv_bases = cl.Buffer(self.dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=bases)
        slot_stride = self._plane(0, 0, 0)[2]
        return bind(program, "decode_layers", (self._layer_groups,), self.b_x, self._packed.buffer,
                    self._layer_table, self._kv_bases, np.int32(c.n_layers), np.float32(c.rms_eps), self.b_qkv,
                    self.b_attn, self.b_attn_sums, self.b_gu, self.b_act, self.b_act_sums, self.b_slots,
                    self.b_pos, self.rope_cs, np.float32(1.0 / np.sqrt(c.head_dim)), self._channels[0],
                    np.int64(slot_stride), np.int64(self.kv.plane_elems), self.b_sync, local_size=(1,))

    def _normed_gemv(self, rows: cl.Buffer, norm_w: cl.Buffer, matrix: DeviceMatrix, y: cl.Buffer, n: int,
                     fuse: bool) -> list[Launch]:
        """y = matrix @ rms_norm(rows[0:n], norm_w): one launch when fuse (one row) and the matrix can
        normalize its input itself (block formats: gemv_quant_norm), else rms_norm into b_xn and a GEMV."""
        c = self.cfg
        if fuse and hasattr(matrix, "bind_gemv_norm"):
            return [matrix.bind_gemv_norm(rows, norm_w, c.rms_eps, y)]
        return [bind(self._p_norm, "rms_norm", (n,), rows, norm_w, self.b_xn, self.b_xn_sums, np.int32(c.hidden),
                     np.float32(c.rms_eps)),
                matrix.bind_gemv(self.b_xn, y, n, x_sums=self.b_xn_sums)]

    def _layers_plan(self, n: int, decode: bool, cache: bool = True) -> tuple[Launch, list[list[Launch]]]:
        """The embedding lookup and every layer's launches over n rows (bound once per (n, decode) when
        cached); decode: one row per sequence, else rows of one prompt."""
        plan = self._layer_plans.get((n, decode))
        if plan is None:
            if decode and n == 1 and self._layer_kernels and self._packed is not None:
                # one launch for every layer, after its counters are zeroed (decode_layers.cl)
                clear = bind(self._p_elem, "clear_ints", (SYNC_LINE * (2 + 2 * self.cfg.n_layers),), self.b_sync)
                layers = [[clear, self._decode_layers_launch()]]
            else:
                layers = [self._bind_layer(li, n, decode) for li in range(self.cfg.n_layers)]
            plan = (self.embed.bind_embed(self.b_tokens, self.b_x, n), layers)
            if cache:
                self._layer_plans[(n, decode)] = plan
        return plan

    def _logits_plan(self, src: str, n: int) -> list[Launch]:
        """Final norm and LM head into b_logits[0:n]: of b_x's n rows (src "rows", a decode step) or of
        b_last's one row (src "last", a prefill's last token)."""
        key = (src, n)
        if key not in self._logits_plans:
            rows = self.b_last if src == "last" else self.b_x
            self._logits_plans[key] = self._normed_gemv(rows, self.final_norm, self.lm_head, self.b_logits, n,
                                                        fuse=n == 1)
        return self._logits_plans[key]

    def _argmax_launch(self, n: int) -> Launch:
        """The greedy pick of each of b_logits' first n rows into b_tokens, and b_pos += 1: the next
        decode step's rows, already on the device."""
        if n not in self._argmax_launches:
            self._argmax_launches[n] = bind(self._p_elem, "argmax_rows", (n * ARGMAX_WG,), self.b_logits,
                                            np.int32(self.cfg.vocab_size), self.b_tokens, self.b_pos,
                                            local_size=(ARGMAX_WG,))
        return self._argmax_launches[n]

    def _keep_awake(self) -> None:
        if self._wake is not None:
            self._wake.touch()

    @staticmethod
    def _replay(queue: cl.CommandQueue, launches: list[Launch]) -> None:
        for launch in launches:
            launch.enqueue(queue)

    def _read_logits(self, n: int) -> np.ndarray:
        out = np.empty((n, self.cfg.vocab_size), np.float32)
        cl.enqueue_copy(self.dev.queue, out, self.b_logits, is_blocking=True)
        return out

    # ---- Engine API ---------------------------------------------------------
    def new_sequence(self, capacity: int) -> OpenCLSequence:
        if capacity > self.max_context:
            raise ValueError(f"sequence of {capacity} positions exceeds the engine's context of {self.max_context}")
        with self._lock:
            if not self._free_slots:
                raise EngineFull(f"all {self.max_sequences} sequence slots of the OpenCL engine are in use")
            return OpenCLSequence(self._free_slots.pop(0), capacity)

    def release(self, seq: OpenCLSequence) -> None:
        with self._lock:
            if seq.slot >= 0 and seq.slot not in self._free_slots:
                self._free_slots.append(seq.slot)
            seq.slot = -1

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def prefill(self, seq: OpenCLSequence, token_ids: list[int], on_layer=None) -> np.ndarray:
        n = len(token_ids)
        assert seq.length == 0 and 0 < n <= seq.capacity, (seq.length, n, seq.capacity)
        with self._lock:
            self._keep_awake()
            q, keep = self.dev.queue, []
            chunks = [(s, min(s + PREFILL_CHUNK, n)) for s in range(0, n, PREFILL_CHUNK)]
            for ci, (s, e) in enumerate(chunks):
                rows, last = e - s, ci == len(chunks) - 1
                self._enqueue_rows(token_ids[s:e], [seq.slot] * rows, range(s, e), keep)
                # full chunks and decode-sized ones recur; a one-off partial chunk is bound and dropped
                embed, layers = self._layers_plan(rows, decode=False,
                                                  cache=rows == PREFILL_CHUNK or rows <= self.max_sequences)
                embed.enqueue(q)
                for li, launches in enumerate(layers):
                    self._replay(q, launches)
                    if on_layer is not None and last:
                        q.finish()  # the layer's KV of the whole prompt is now in the cache
                        on_layer(li)
                if last:
                    row_bytes = self.cfg.hidden * 4
                    cl.enqueue_copy(q, self.b_last, self.b_x, byte_count=row_bytes, src_offset=(rows - 1) * row_bytes)
                    self._replay(q, self._logits_plan("last", 1))
                else:
                    q.finish()  # the next chunk reuses the row buffers
            seq.length = n
            return self._read_logits(1)[0]

    def _enqueue_decode(self, seqs: list[OpenCLSequence], tokens: list[int], keep: list,
                        greedy: bool) -> np.ndarray | None:
        """Enqueue a decode step (and, greedy, its picks), without waiting; returns the host array the
        step's decode_layers failure flag is read into (see _drop_layer_kernels), else None."""
        b = len(seqs)
        assert b == len(tokens) and 0 < b <= self.max_sequences
        assert len({s.slot for s in seqs}) == b, "a sequence appears twice in one decode step"
        for s in seqs:
            assert s.length < s.capacity, "sequence is full"
        self._keep_awake()
        q = self.dev.queue
        self._enqueue_rows(tokens, [s.slot for s in seqs], [s.length for s in seqs], keep)
        embed, layers = self._layers_plan(b, decode=True)
        gate = None
        if layers[0][0].kernel.function_name == "clear_ints":
            # decode_layers' work-groups spin at their barriers and hold every core: a host thread
            # enqueuing while they run waits for a core, and the device for its next command. So the
            # whole step is enqueued behind a gate first, and only then let go.
            gate = cl.UserEvent(self.dev.context)
        try:
            cl.enqueue_nd_range_kernel(q, embed.kernel, embed.global_size, embed.local_size,
                                       wait_for=[gate] if gate is not None else None)
            for launches in layers:
                self._replay(q, launches)
            self._replay(q, self._logits_plan("rows", b))
            if greedy:
                self._rows_on_device = None  # until the picks are read: argmax_rows rewrites the rows
                self._argmax_launch(b).enqueue(q)
        finally:  # whatever happened, the queue must not stay held back
            if gate is not None:
                gate.set_status(cl.command_execution_status.COMPLETE)
        failed = None
        if gate is not None:  # (PoCL's non-blocking read of a buffer waits while a user event holds the queue)
            failed = np.zeros(1, np.int32)
            cl.enqueue_copy(q, failed, self.b_sync, is_blocking=False)
        for s in seqs:
            s.length += 1
        return failed

    def decode(self, seqs: list[OpenCLSequence], tokens: list[int]) -> np.ndarray:
        with self._lock:
            keep: list = []
            failed = self._enqueue_decode(seqs, tokens, keep, greedy=False)
            logits = self._read_logits(len(seqs))
            if failed is not None and failed[0]:
                self._drop_layer_kernels(seqs)
                return self.decode(seqs, tokens)
            return logits

    def decode_greedy(self, seqs: list[OpenCLSequence], tokens: list[int]) -> list[int]:
        with self._lock:
            keep: list = []
            failed = self._enqueue_decode(seqs, tokens, keep, greedy=True)
            out = np.empty(len(seqs), np.int32)
            cl.enqueue_copy(self.dev.queue, out, self.b_tokens, is_blocking=True)  # the one wait of this step
            if failed is not None and failed[0]:
                self._drop_layer_kernels(seqs)
                return self.decode_greedy(seqs, tokens)
            picks = out.tolist()
            self._rows_on_device = (tuple(picks), tuple(s.slot for s in seqs), tuple(s.length for s in seqs))
            return picks

    def _drop_layer_kernels(self, seqs: list[OpenCLSequence]) -> None:
        """A decode_layers launch gave up (its work-groups did not all run at once): its step is void.
        From now on one-sequence steps run launch by launch; the caller redoes this one, so the
        sequences go back a position and the rows are uploaded again (the KV written at that
        position is rewritten with the same values)."""
        log.warning("decode_layers' work-groups did not all run at once on %s; one-sequence decode steps "
                    "run launch by launch from now on", self.device_name)
        self._layer_kernels = False
        self._layer_plans = {k: v for k, v in self._layer_plans.items() if not k[1]}
        for s in seqs:
            s.length -= 1
        self._rows_on_device = None

    def import_kv_layer(self, seq: OpenCLSequence, layer: int, kv: np.ndarray) -> None:
        c = self.cfg
        assert kv.shape[:2] == (2, c.n_kv_heads) and kv.shape[3] == c.head_dim, kv.shape
        n = kv.shape[2]
        assert n <= seq.capacity, f"{n} tokens do not fit the sequence's {seq.capacity} positions"
        host = np.ascontiguousarray(kv, np.float32)  # fp16 on the wire is widened here
        seq._keep_alive.append(host)
        with self._lock:
            for k_or_v in range(2):
                for h in range(c.n_kv_heads):
                    ch, off = self.kv.locate(seq.slot, layer, k_or_v, h)
                    cl.enqueue_copy(self.dev.queue, self._channels[ch], host[k_or_v, h], dst_offset=off * 4,
                                    is_blocking=False)

    def finish_import(self, seq: OpenCLSequence, n_tokens: int) -> None:
        self.dev.queue.finish()
        seq._keep_alive.clear()
        seq.length = n_tokens

    def read_kv(self, seq: OpenCLSequence, n_tokens: int) -> np.ndarray:
        """The sequence's first n_tokens of KV in wire layout (tests and debugging)."""
        from services.decode_fpga.kv_channels import channels_to_wire

        with self._lock:
            host = []
            for c, buf in enumerate(self._channels):
                a = np.empty(max(1, self.kv.channel_elems(c)), np.float32)
                cl.enqueue_copy(self.dev.queue, a, buf, is_blocking=True)
                host.append(a)
        return channels_to_wire(self.kv, seq.slot, n_tokens, host)
