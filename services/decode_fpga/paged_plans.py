"""The launches of a paged step (the continuous-batching path), bound once and replayed for every step.

A step runs rows of several sequences through every layer, K and V read and written through
block tables (kernels/paged_attention.cl), and the logits of its sampling rows only. Every
launch is bound once to the scratch buffers, the pool and the step's int inputs
(paged_step_rows.py); a step only changes global sizes and offsets (launch.RowLaunch), so steps
of any shape cost no argument setting (~40 µs a kernel in pyopencl).

Batch invariance: every launch computes each row as it would alone. The GEMVs are the
`*_rows` kernels and gemv_quant_tiles(1) (quant_gemv.py: the one-row arithmetic for any number
of rows, never the several-row passes of gemv / gemv_quant); RMSNorm, SiLU and the attention
kernels are per row already; one-token
chunks always take the decode attention kernel and longer chunks always the prefill one
(paged_step_rows.py). The one-row fused kernels (norm and SiLU prologues) compute the same
bits as the launches here, but are not used: one set of launches serves every step.

On a CPU device with packed block weights, a step of one decode row runs every layer in one
launch (paged_decode_layers, decode_layers.cl built over the pool): the same bits as the layers'
launches here, ~half the time at batch 1 on PoCL (bench/micro/paged_step.py). A step of 2 to
ONE_LAUNCH_ROWS rows (a few sequences' decodes, a speculative verify chunk) may run as one launch
too (paged_rows_layers, the same bits). The engine picks one launch or these launches step by step,
for each row count (one_launch_choice.py).
"""
from __future__ import annotations

import numpy as np
import pyopencl as cl

from services.decode_fpga.arch_parts import ArchKernels
from services.decode_fpga.device import DeviceContext
from services.decode_fpga.device_logprobs import DeviceLogprobs
from services.decode_fpga.device_weights import DeviceWeights
from services.decode_fpga.launch import Launch, RowLaunch, bind_rows
from services.decode_fpga.one_launch_choice import BARRIER_SPIN_LIMIT
from services.decode_fpga.paged_attention import scores_positions
from services.decode_fpga.paged_kv_store import PagedKVStore
from services.decode_fpga.paged_step_rows import PagedStepInputs, StepRows
from services.decode_fpga.scratch import SYNC_LINE, Scratch, blocks32
from services.model.config import ModelConfig

ARGMAX_WG = 256  # work-items per row of argmax_rows
# the most rows paged_rows_layers takes: a verify chunk of k = 3 drafts, the batched GEMVs' pass of four
ONE_LAUNCH_ROWS = 4
Span = str  # which rows a launch covers: StepRows.span's names, "all", "decodes", "chunks", "samples"


def spanning(launch: Launch, rows_dim: int = 0) -> RowLaunch:
    """A Launch whose rows_dim counts rows, as a RowLaunch."""
    return RowLaunch(launch.kernel, launch.global_size, rows_dim, 1, launch.local_size)


class PagedStepPlans:
    def __init__(self, dev: DeviceContext, cfg: ModelConfig, weights: DeviceWeights, store: PagedKVStore,
                 scratch: Scratch, inputs: PagedStepInputs, max_samples: int, one_launch: bool = False,
                 layer_groups: int = 1):
        self.dev, self.cfg, self.weights, self.store, self.s, self.inputs = dev, cfg, weights, store, scratch, inputs
        self._elementwise = dev.build("elementwise.cl", {"ARGMAX_WG": ARGMAX_WG})
        self._arch = ArchKernels(dev, cfg, self._elementwise)  # the architecture's norm, activation, extras
        ctx = dev.context
        # the sampling rows gathered, their logits [max_samples, vocab] and greedy picks
        self.sampled = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max_samples * cfg.hidden * 4)
        self.logits = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max_samples * cfg.vocab_size * 4)
        self.picks = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max_samples * 4)
        self._argmax_pos = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, max_samples * 4)  # argmax_rows' +1s, unread
        self.logprobs = DeviceLogprobs(dev, self.logits, cfg.vocab_size, max_samples)
        b = inputs.buffers
        self.embed = spanning(weights.embed.bind_embed(b["tokens"], scratch.x, 1))
        self.layers = [self._bind_layer(li) for li in range(cfg.n_layers)]
        self.head = self._bind_head()
        self.argmax = bind_rows(self._elementwise, "argmax_rows", (ARGMAX_WG,), self.logits,
                                np.int32(cfg.vocab_size), self.picks, self._argmax_pos, rows_scale=ARGMAX_WG,
                                local_size=(ARGMAX_WG,))
        # one decode row: [clear_ints, paged_decode_layers]; 2 to ONE_LAUNCH_ROWS rows: [clear_ints,
        # paged_rows_layers]; or None
        packed = one_launch and weights.packed is not None
        self.one_launch = self._bind_one_launch(layer_groups) if packed else None
        self.one_launch_rows = self._bind_rows_launch(layer_groups) if packed else None

    def can_run_as_one_launch(self, rows: StepRows) -> bool:
        """Whether this step's layers may run as one launch: one decode row, or 2 to ONE_LAUNCH_ROWS rows
        of any chunks (the launches bound)."""
        if rows.n_rows == 1:
            return self.one_launch is not None and rows.n_decodes == 1
        return self.one_launch_rows is not None and rows.n_rows <= ONE_LAUNCH_ROWS

    def one_launch_for(self, rows: StepRows) -> list[RowLaunch]:
        """The one-launch step's launches for these rows (can_run_as_one_launch)."""
        return self.one_launch if rows.n_rows == 1 else self.one_launch_rows

    # ---- replay -------------------------------------------------------------------------
    def enqueue_layer(self, queue: cl.CommandQueue, li: int, rows: StepRows) -> None:
        for span, launch in self.layers[li]:
            launch.enqueue(queue, *rows.span(span))

    def enqueue_head(self, queue: cl.CommandQueue, rows: StepRows, greedy: bool, logprobs_k: int | None = None) -> None:
        """Logits of the sampling rows into self.logits[0:n_samples]; greedy: their argmax into self.picks;
        logprobs_k: instead, their argmax, logprobs and k best (self.logprobs, its targets uploaded)."""
        for span, launch in self.head:
            launch.enqueue(queue, *rows.span(span))
        if logprobs_k is not None:
            self.logprobs.enqueue(queue, rows.n_samples, logprobs_k)
        elif greedy:
            self.argmax.enqueue(queue, *rows.span("samples"))

    # ---- binding --------------------------------------------------------------------------
    def _norm(self, rows: cl.Buffer, norm_w: cl.Buffer, norm_b: cl.Buffer | None) -> RowLaunch:
        """The architecture's norm of the rows into scratch.xn (and its block sums)."""
        return spanning(self._arch.norm(rows, norm_w, norm_b, self.s.xn, self.s.xn_sums, 1))

    def _bind_layer(self, li: int) -> list[tuple[Span, RowLaunch]]:
        """Layer li over the step's rows of scratch.x, in order; the architecture's extra parts
        (arch_parts.py) where its vectors exist."""
        c, s, layer, st = self.cfg, self.s, self.weights.layers[li], self.store
        ext, ak = self.weights.arch.layers[li], self._arch
        b, n_rows = self.inputs.buffers, self.inputs.buffers["n_rows"]
        pool, mb, pa = st.pool, st.max_blocks, st.kernels
        seq, pos, tables = b["seq_of_row"], b["pos"], b["block_tables"]
        out: list[tuple[Span, RowLaunch]] = []
        if li == 0 and self.weights.arch.pos_embed is not None:  # learned positions, before the first layer
            out.append(("all", spanning(ak.add_positions(s.x, self.weights.arch.pos_embed, pos, 1))))
        out += [("all", self._norm(s.x, layer.attn_norm, ext.attn_norm_b)),
                ("all", layer.qkv.bind_gemv_rows(s.xn, s.qkv, n_rows, x_sums=s.xn_sums))]
        if ext.b_qkv is not None:
            out.append(("all", spanning(ak.add_bias(s.qkv, ext.b_qkv, c.q_dim + 2 * c.kv_dim, 1))))
        if ext.q_norm is not None:  # before RoPE, which the attention launches apply
            out.append(("all", spanning(ak.head_norm(s.qkv, ext.q_norm, ext.k_norm, 1))))
        out += [
            ("decodes", spanning(pa.bind_decode(1, s.qkv, seq, pos, s.rope_cs, tables, mb, pool, li, s.attn,
                                                s.attn_sums))),
            ("chunks", spanning(pa.bind_rope_store(1, s.qkv, seq, pos, s.rope_cs, tables, mb, pool, li))),
            ("chunks", spanning(pa.bind_attention(1, s.qkv, seq, pos, tables, mb, pool, li, s.attn, s.attn_sums))),
        ]
        if c.head_dim % 32 and layer.o.needs_block_sums:  # attention writes the sums only of whole blocks
            out.append(("all", spanning(layer.o.bind_block_sums(s.attn, s.attn_sums, 1))))
        out.append(("all", layer.o.bind_gemv_rows(s.attn, s.x, n_rows, accumulate=True, x_sums=s.attn_sums)))
        if ext.bo is not None:  # (the residual above, then the bias)
            out.append(("all", spanning(ak.add_bias(s.x, ext.bo, c.hidden, 1))))
        out += [("all", self._norm(s.x, layer.ffn_norm, ext.ffn_norm_b)),
                ("all", layer.gate_up.bind_gemv_rows(s.xn, s.gu, n_rows, x_sums=s.xn_sums))]
        if ext.b_gate_up is not None:
            out.append(("all", spanning(ak.add_bias(s.gu, ext.b_gate_up, layer.gate_up.rows, 1))))
        out += [("all", spanning(ak.activation(s.gu, s.act, s.act_sums, 1))),
                ("all", layer.down.bind_gemv_rows(s.act, s.x, n_rows, accumulate=True, x_sums=s.act_sums))]
        if ext.b_down is not None:
            out.append(("all", spanning(ak.add_bias(s.x, ext.b_down, c.hidden, 1))))
        return out

    @property
    def _xl(self) -> int:
        """decode_layers.cl's XL: the longest vector a phase reads."""
        return max(self.cfg.hidden, self.cfg.intermediate, self.cfg.q_dim)

    def _layers_program(self, rows: int | None = None, max_pos: int | None = None) -> cl.Program:
        """decode_layers.cl for this model and pool; rows: its several-row kernel's bound (ROWS); max_pos:
        that kernel's attention takes a kv head's query heads at once, the scores of MAX_POS positions."""
        c, packed, st = self.cfg, self.weights.packed, self.store
        return self.dev.build("decode_layers.cl", {
            "QFMT_SET": packed.qfmt_set, "HIDDEN": c.hidden, "FF": c.intermediate,
            "HEAD_DIM": c.head_dim, "GROUP": c.n_heads // c.n_kv_heads, "Q_DIM": c.q_dim, "KV_DIM": c.kv_dim,
            "XL": self._xl, "LINE": SYNC_LINE, "BLOCK_SIZE": st.layout.block_size,
            "SPIN_LIMIT": f"{BARRIER_SPIN_LIMIT}L", **({"ROWS": rows} if rows else {}),
            **({"MAX_POS": max_pos} if max_pos else {}), **self.weights.arch.one_launch_defines()})

    def _bind_layers(self, program: cl.Program, kernel: str, layer_groups: int, counters: int,
                     n_rows: tuple = ()) -> list[RowLaunch]:
        """[clear_ints over the barrier's and `counters` work counters a layer, `kernel` over every layer]:
        decode_layers.cl's kernels take the same arguments, the several-row one with n_rows before seq_of_row."""
        c, s, packed, st = self.cfg, self.s, self.weights.packed, self.store
        b = self.inputs.buffers
        clear = bind_rows(self._elementwise, "clear_ints", (SYNC_LINE * (2 + counters * c.n_layers),), s.sync,
                          rows_dim=None)
        layers = bind_rows(program, kernel, (layer_groups,), s.x, packed.arrays.buffer, packed.table,
                           np.int32(c.n_layers), np.float32(c.rms_eps), s.qkv, s.attn, s.attn_sums, s.gu, s.act,
                           s.act_sums, *n_rows, b["seq_of_row"], b["pos"], s.rope_cs,
                           np.float32(1.0 / np.sqrt(c.head_dim)), st.pool, np.int64(st.layout.layer_elems),
                           b["block_tables"], np.int32(st.max_blocks), s.sync, *self.weights.arch.one_launch_args(),
                           rows_dim=None, local_size=(1,))
        return [clear, layers]

    def _bind_rows_launch(self, layer_groups: int) -> list[RowLaunch] | None:
        """Every layer of a step of 2 to ONE_LAUNCH_ROWS rows as one launch, after its counters are zeroed;
        None where its local arrays (the rows of a GEMV's input, and a kv head's scores where PagedAttention
        keeps them) would not fit in the device's local memory."""
        c, st = self.cfg, self.store
        max_pos = scores_positions(st.max_blocks * st.layout.block_size) if st.kernels.scores_fit(st.max_blocks) else 0
        local_bytes = 4 * (ONE_LAUNCH_ROWS * (self._xl + self._xl // 32) + (c.n_heads // c.n_kv_heads) * max_pos)
        if local_bytes > self.dev.device.local_mem_size:
            return None
        return self._bind_layers(self._layers_program(ONE_LAUNCH_ROWS, max_pos), "paged_rows_layers", layer_groups,
                                 3, (self.inputs.buffers["n_rows"],))

    def _bind_one_launch(self, layer_groups: int) -> list[RowLaunch]:
        """Every layer of a one-decode step as one launch, after its counters are zeroed."""
        return self._bind_layers(self._layers_program(), "paged_decode_layers", layer_groups, 2)

    def _bind_head(self) -> list[tuple[Span, RowLaunch]]:
        """The sampling rows of scratch.x gathered into self.sampled, the final norm, the LM head."""
        c, s, w = self.cfg, self.s, self.weights
        b = self.inputs.buffers
        return [
            ("samples", bind_rows(self._elementwise, "gather_rows", (1,), s.x, b["sample_rows"], self.sampled,
                                  np.int32(c.hidden), by_row=True)),
            ("samples", self._norm(self.sampled, w.final_norm, w.arch.final_norm_b)),
            ("samples", w.lm_head.bind_gemv_rows(s.xn, self.logits, b["n_samples"], x_sums=s.xn_sums)),
        ]
