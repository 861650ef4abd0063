"""Weight matrices kept on the device as the checkpoint's GGUF blocks (a DeviceMatrix, see gemv.py).

(Just past 300 lines on purpose: each format's upload layout and the launches that read it are one
contract with kernels/quant_blocks.h; split by format, a layout change would touch several files.)

Q4_1 costs 20 bytes per 32 weights in the file (a fifth of fp32), 22 on the device
(scales widened to fp32, see below), and the kernel dequantizes in registers to
exactly the values `gguf.quants.dequantize` gives, accumulating in fp32: one
work-item per output row on a CPU or an FPGA (kernels/gemv_quant.cl), a
work-group of lanes per row on a GPU (kernels/gemv_quant_wg.cl; the device's
`lanes_per_row`).

At upload the blocks are split into three arrays, values unchanged: the scales
(widened to fp32, exactly, so the one-row loop broadcasts them from memory),
the minimums (fp16 for Q4_1/Q5_1) and the quants, so no load straddles a scale
and its quants; scale rows are padded to a multiple of 4 blocks for 4-wide loads.
Q5_0, Q5_1 and the K-quants (Q4_K, Q5_K, Q6_K) become the same 32-weight blocks,
the quants repacked into Q4's nibble order with their fifth bits after them in
weight order (each lane of the kernel rotates its own into place; Q6_K: weights
0..15 whole in a byte each, 16..31 split, see quant_blocks.h); a K-quant keeps its super-blocks' fp16 scales (widened to fp32) and each
block's small integer scale and minimum as bytes, multiplied in the kernel a
super-block at a time (exact products: kernels/quant_blocks.h). Device bits a weight against
the file's: Q4_K 4.75 / 4.5, Q5_K 5.75 / 5.5, Q6_K 6.63 / 6.56, Q5_0 6 / 5.5,
Q5_1 6.5 / 6.

This module is one matrix; which GGUF tensors make up a layer's matrices and
how they sit on the device is device_weights.py's (gguf_weights).
"""
from __future__ import annotations

import numpy as np
import pyopencl as cl

from services.decode_fpga.device import DeviceContext
from services.decode_fpga.gemv import EnqueueOnce, upload_dense_matrix
from services.decode_fpga.int8_gemv import bind_int8_gemv_rows, takes_int8
from services.decode_fpga.launch import ByRowCount, Launch, RowLaunch, balanced_groups, bind, bind_rows, row_groups
from services.decode_fpga.settings import GEMV_TILE
from services.model.formats import FORMATS, kernel_defines
from services.model.gguf_blocks import BlockTensor

# views of services/model/formats.py's table, by format name: the code in the kernels (quant_blocks.h),
# the bit in decode_layers.cl's QFMT_SET, and the formats whose one-row GEMVs read x's block sums
QFMT_CODES = {f.name: f.code for f in FORMATS.values() if f.is_block}
QFMT_BITS = {f.name: f.bit for f in FORMATS.values() if f.is_block}
MINIMUM_FORMATS = tuple(f.name for f in FORMATS.values() if f.has_mins)
MF = cl.mem_flags
GEMV_TILE_ROWS = 4  # rows of x per pass of gemv_quant_tiles (its TILE_R): 8 and (with 4 outputs) 4 spilled
# gemv_quant_tiles runs once the rows of x hold more than this (a core's L1 data cache here: 48 KiB),
# gemv_quant_tiles1 (one output a work-item) below it: while x stays in L1 a tile of outputs saves
# nothing, and on the LM head (32 MB) two outputs a work-item at 2-4 rows measured ~1.7x the CPU time
GEMV_TILE_X_BYTES = 48 << 10


def _halves(raw: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of every block of raw [rows, nb, bytes], widened to float32."""
    return np.ascontiguousarray(raw[..., offset:offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(v: np.ndarray) -> np.ndarray:
    """Quant values v [rows, nb, 32] as the Q4 bytes: byte j = v[j] & 15 | (v[j + 16] & 15) << 4."""
    return ((v[..., :16] & 15) | ((v[..., 16:] & 15) << 4)).astype(np.uint8)


def _fifth_bits(v: np.ndarray) -> np.ndarray:
    """Bit 4 of v [rows, nb, 32] as 4 bytes a block: a little-endian uint, bit j of weight j."""
    return np.packbits((v >> 4) & 1, axis=-1, bitorder="little")


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 quant bytes [rows, nsb, 128] as values [rows, nsb, 256]: 32 bytes hold
    weights 64c..64c+31 (low nibbles) and 64c+32..64c+63 (high)."""
    qs = qs.reshape(*qs.shape[:2], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    return (qs & 15).reshape(*qs.shape[:2], 256)


def _q6_parts(v: np.ndarray) -> list[np.ndarray]:
    """Q6_K's values v [rows, nb, 32] as its 24 bytes a block (kernels/quant_blocks.h): byte j = v[j] |
    (v[16 + j] & 3) << 6, then v[16 + j] >> 2 as a nibble at bit 32 (j & 1) + 4 (j >> 1) of a ulong."""
    low = (v[..., :16] | (v[..., 16:] & 3) << 6).astype(np.uint8)
    h = (v[..., 16:] >> 2).reshape(*v.shape[:-1], 4, 2, 2)  # j = 4 byte + 2 nibble + uint
    high = (h[..., 0, :] | h[..., 1, :] << 4).astype(np.uint8)  # [..., byte in its uint, uint]
    return [low, np.swapaxes(high, -1, -2).reshape(*v.shape[:-1], 8)]


def _values(t: BlockTensor) -> np.ndarray:
    """The unsigned quant values [rows, nb, 32] (int32) of a 5-bit, 6-bit or K format, per 32-weight
    block in weight order (gguf's weight: d (v - offset), or d v + m)."""
    raw = t.blocks()
    rows = t.rows
    if t.qtype in ("q5_0", "q5_1"):
        head = 2 if t.qtype == "q5_0" else 4
        qh = np.ascontiguousarray(raw[..., head:head + 4]).view("<u4")  # [rows, nb, 1]
        qs = raw[..., head + 4:].astype(np.int32)
        return np.concatenate([qs & 15, qs >> 4], axis=-1) | (((qh >> np.arange(32, dtype=np.uint32)) & 1)
                                                               .astype(np.int32) << 4)
    if t.qtype in ("q4_k", "q5_k"):
        v = _k_low_nibbles(raw[..., 16:144] if t.qtype == "q4_k" else raw[..., 48:176]).astype(np.int32)
        if t.qtype == "q5_k":  # bit s of qh[j]: weight 32 s + j's fifth bit
            qh = raw[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            v |= (qh & 1).reshape(rows, -1, 256).astype(np.int32) << 4
        return v.reshape(rows, -1, 32)
    if t.qtype == "q6_k":  # ql[128] qh[64] scales[16] (int8) d (fp16)
        ql = raw[..., :128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        qh = raw[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
        v = (ql & 15).reshape(rows, -1, 256).astype(np.int32) | ((qh & 3).reshape(rows, -1, 256).astype(np.int32) << 4)
        return v.reshape(rows, -1, 32)
    raise ValueError(f"{t.name}: {t.qtype} has no 5-bit, 6-bit or K layout")


def _k_scales(t: BlockTensor) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant's d (float32 [rows, nsb * 2]: d, dmin of each super-block; Q6_K [rows, nsb]: d) and
    m (uint8 [rows, nb * 2]: each block's integer scale and minimum; Q6_K: its halves' int8 scales)."""
    from gguf.quants import Q4_K

    raw = t.blocks()
    rows, nsb = raw.shape[:2]
    if t.qtype == "q6_k":
        return _halves(raw, 208), np.ascontiguousarray(raw[..., 192:208]).reshape(rows, -1)
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(raw[..., 4:16]).reshape(-1, 12))
    d = np.stack([_halves(raw, 0), _halves(raw, 2)], axis=-1).reshape(rows, -1)
    m = np.stack([sc.reshape(rows, nsb * 8), mn.reshape(rows, nsb * 8)], axis=-1).astype(np.uint8)
    return d, m.reshape(rows, -1)


def split_blocks(t: BlockTensor) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The device arrays of a block matrix (gemv_quant.cl's layout, quant_blocks.h's scales): d fp32
    [rows, nbp] (the scales; K-quants their super-blocks' d and dmin), m [rows, nbp] fp16 (the
    minimums of Q4_1/Q5_1; K-quants uint8 [rows, 2 nb]: each block's integer scale and minimum,
    Q6_K its halves' int8 scales; else None), quants uint8 [rows, nb * QBYTES]; nb = cols / 32
    blocks, nbp = nb rounded up to 4, the padding is zero. Every value is the block's own."""
    if t.qtype not in QFMT_CODES:
        raise ValueError(f"{t.name}: {t.qtype} is not a block format ({sorted(QFMT_CODES)})")
    nb = t.cols // 32
    nbp = (nb + 3) // 4 * 4

    def padded(a: np.ndarray, per: int, dtype) -> np.ndarray:
        out = np.zeros((t.rows, nbp * per), dtype)
        out[:, :nb * per] = a
        return out

    fmt = FORMATS[t.qtype]
    if fmt.repack == "split":  # the file's quants as they are, after their scales
        blocks = t.blocks()  # [rows, nb, block_bytes]
        head = 4 if fmt.has_mins else 2  # bytes before the quants: d (and m)
        d = padded(_halves(blocks, 0), 1, np.float32)
        m = padded(_halves(blocks, 2), 1, np.float16) if fmt.has_mins else None
        return d, m, np.ascontiguousarray(blocks[:, :, head:]).reshape(t.rows, -1)
    v = _values(t)
    parts = _q6_parts(v) if fmt.repack == "q6" else [_nibbles(v)]
    if fmt.repack == "q5":
        parts.append(_fifth_bits(v))
    quants = np.ascontiguousarray(np.concatenate(parts, axis=-1)).reshape(t.rows, -1)
    if fmt.per_block == 32:  # Q5_0, Q5_1: a block's own fp16 d (and m)
        blocks = t.blocks()
        m = padded(_halves(blocks, 2), 1, np.float16) if fmt.has_mins else None
        return padded(_halves(blocks, 0), 1, np.float32), m, quants
    d, m = _k_scales(t)  # a whole number of super-blocks: nbp == nb, nothing to pad
    return np.ascontiguousarray(d, np.float32), m, quants


class QuantMatrix(EnqueueOnce):
    """A [rows, cols] matrix in one of QFMT_CODES' formats resident on the device; implements DeviceMatrix."""

    def __init__(self, dev: DeviceContext, t: BlockTensor, buffers: tuple | None = None, split: tuple | None = None,
                 y_offset: int = 0, y_stride: int | None = None):
        """buffers: the device copies of split_blocks(t)'s arrays (d, m or None, quants) where the caller
        has placed them (packed_arrays.py); else each is uploaded into a buffer of its own. split: those
        arrays, when the caller has them already. y_offset, y_stride: this matrix is rows
        [y_offset, y_offset + rows) of a stacked output whose rows are y_stride apart (stacked_matrix.py);
        its GEMVs write y[b, y_offset + r] of a y [batch, y_stride]."""
        if t.qtype not in QFMT_CODES:
            raise ValueError(f"{t.name}: {t.qtype} is not a block format ({sorted(QFMT_CODES)})")
        self.name, self.rows, self.cols, self.fmt = t.name, t.rows, t.cols, t.qtype
        d, m, quants = split if split is not None else split_blocks(t)

        def up(a: np.ndarray) -> cl.Buffer:
            return cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a))

        d_buf, m_buf, q_buf = buffers if buffers is not None else (up(d), up(m) if m is not None else None, up(quants))
        self._d, self._q = d_buf, q_buf
        self._m = m_buf if m_buf is not None else self._d  # unread unless the format has minimums
        self.nbytes = d.nbytes + (m.nbytes if m is not None else 0) + quants.nbytes
        self._dev = dev
        # the output's place (the kernels' y_offset, y_stride arguments); none: y is [batch, rows]
        self._y_offset, self._y_stride = np.int32(y_offset), np.int32(self.rows if y_stride is None else y_stride)
        self.lanes = dev.lanes_per_row  # 1: gemv_quant.cl, more: gemv_quant_wg.cl
        # output rows per work-item of the batched GEMV (gemv_quant_tiles), 0: gemv_quant_rows
        self.tile = dev.gemv_tile if self.lanes == 1 else 0
        # the tiles kernels are in the program whether or not they run (tile 0, a GPU's lanes): their
        # default shape then, so the program is the CPU default's and is built once, not twice
        tiles = {"TILE_O": self.tile or GEMV_TILE, "TILE_R": GEMV_TILE_ROWS}
        self.tile_above = max(1, GEMV_TILE_X_BYTES // (4 * self.cols))  # rows of x past which the tiles run
        self._program = dev.build("gemv_quant.cl", {**kernel_defines(t.qtype), **tiles})

    @property
    def device_arrays(self) -> tuple[cl.Buffer, cl.Buffer, cl.Buffer]:
        """The scales, minimums (the scales again where the format has none) and quants, in the order
        the kernels take them."""
        return self._d, self._m, self._q

    @property
    def needs_block_sums(self) -> bool:
        """A format with minimums at one row reads the block sums of x (gemv_quant.cl): sum_b m_b *
        xsum_b. The GPU kernels dequantize d*q + m per weight and read none."""
        return self.fmt in MINIMUM_FORMATS and self.lanes == 1

    def _wg_program(self, norm_cols: int | None = None) -> cl.Program:
        defines = {**kernel_defines(self.fmt), "WG": self.lanes}
        if norm_cols is not None:
            defines["NORM_COLS"] = norm_cols
        return self._dev.build("gemv_quant_wg.cl", defines)

    def bind_gemv(self, x: cl.Buffer, y: cl.Buffer, batch: int, accumulate: bool = False,
                  x_sums: cl.Buffer | None = None) -> Launch:
        """y[b, r] (+)= sum_c W[r, c] x[b, c] for b < batch; x [batch, cols], y [batch, rows] fp32;
        x_sums [batch, cols / 32]: x's block sums, needed when `needs_block_sums`."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if x_sums is None:
            if self.needs_block_sums:
                raise ValueError(f"{self.name}: a {self.fmt} GEMV needs the block sums of x (x_sums)")
            x_sums = x  # unread
        if self.lanes > 1:
            return bind(self._wg_program(), "gemv_quant_wg", (self.rows * self.lanes, batch), self._d, self._m,
                        self._q, x, y, np.int32(self.cols), np.int32(self.rows), np.int32(bool(accumulate)),
                        self._y_offset, self._y_stride, local_size=(self.lanes, 1))
        return bind(self._program, "gemv_quant", (self.rows,), self._d, self._m, self._q, x, x_sums, y,
                    np.int32(self.cols), np.int32(self.rows), np.int32(batch), np.int32(bool(accumulate)),
                    self._y_offset, self._y_stride, by_row=True)

    def bind_gemv_rows(self, x: cl.Buffer, y: cl.Buffer, n_rows: cl.Buffer, accumulate: bool = False,
                       x_sums: cl.Buffer | None = None) -> RowLaunch | ByRowCount:
        """bind_gemv for any number of rows, each with the one-row arithmetic (batch invariance): on a
        CPU gemv_quant_tiles1 (one output row a work-item) up to `tile_above` rows and gemv_quant_tiles
        (`tile` output rows a work-item) past them, or gemv_quant_rows (the kernel before them) when
        tile is 0, all reading the row count from n_rows[0]; on a GPU gemv_quant_wg, whose work-groups
        already compute each row alone, over the RowLaunch's rows. With int8 activations on a CPU
        (int8_gemv.py, the formats it takes): quantize_x8 and gemv_int8_rows instead."""
        if takes_int8(self._dev, self.fmt, self.lanes):  # the opt-in int8 activations (int8_gemv.py)
            return bind_int8_gemv_rows(self, x, y, n_rows, accumulate, x_sums)
        if self.lanes > 1:
            return bind_rows(self._wg_program(), "gemv_quant_wg", (self.rows * self.lanes, 1), self._d, self._m,
                             self._q, x, y, np.int32(self.cols), np.int32(self.rows), np.int32(bool(accumulate)),
                             self._y_offset, self._y_stride, rows_dim=1, local_size=(self.lanes, 1))
        if x_sums is None:
            if self.needs_block_sums:
                raise ValueError(f"{self.name}: a {self.fmt} GEMV needs the block sums of x (x_sums)")
            x_sums = x  # unread
        args = (self._d, self._m, self._q, x, x_sums, y, np.int32(self.cols), np.int32(self.rows), n_rows,
                np.int32(bool(accumulate)), self._y_offset, self._y_stride)
        if not self.tile:
            return bind_rows(self._program, "gemv_quant_rows", (self.rows,), *args, rows_dim=None, by_row=True)
        d = self._dev.device

        def tiled(kernel: str, outputs: int) -> RowLaunch:
            items = -(-self.rows // outputs)
            local = row_groups(self._program, (items,))
            if local is not None:
                # a CPU: one tile a work-group, one compile whatever the matrix's shape (row_groups);
                # PoCL hands the groups to the cores as they free up (batch 64: 5.25 -> 4.80 ms a row)
                return bind_rows(self._program, kernel, (items,), *args, rows_dim=None, local_size=local)
            # elsewhere as many work-groups on each compute unit, so none idles at the end
            size, local = balanced_groups(items, d.max_compute_units, d.max_work_group_size)
            return bind_rows(self._program, kernel, (size,), *args, rows_dim=None, local_size=(local,))

        return ByRowCount(tiled("gemv_quant_tiles1", 1), tiled("gemv_quant_tiles", self.tile), self.tile_above)

    fuses_norm = True  # bind_gemv_norm runs with any lanes per row

    def bind_gemv_norm(self, x: cl.Buffer, norm_w: cl.Buffer, eps: float, y: cl.Buffer,
                       accumulate: bool = False) -> Launch:
        """y[r] (+)= sum_c W[r, c] rms_norm(x, norm_w)[c] for one row x [cols]: the norm computed by
        each work-group as the GEMV's prologue (gemv_quant_norm), one launch instead of two."""
        if self.lanes > 1:
            return bind(self._wg_program(self.cols), "gemv_quant_norm_wg", (self.rows * self.lanes,), self._d,
                        self._m, self._q, x, norm_w, np.float32(eps), y, np.int32(self.rows),
                        np.int32(bool(accumulate)), self._y_offset, local_size=(self.lanes,))
        program = self._dev.build("gemv_quant.cl",
                                  {**kernel_defines(self.fmt), "NORM_COLS": self.cols})
        return bind(program, "gemv_quant_norm", (self.rows,), self._d, self._m, self._q, x, norm_w,
                    np.float32(eps), y, np.int32(self.rows), np.int32(bool(accumulate)), self._y_offset)

    @property
    def fuses_silu(self) -> bool:
        """Whether bind_gemv_silu is offered: the one-work-item-per-row kernel (a CPU or an FPGA), on
        whole 32-column blocks."""
        return self.lanes == 1 and self.cols % 32 == 0

    def bind_gemv_silu(self, gu: cl.Buffer, y: cl.Buffer, accumulate: bool = False) -> Launch:
        """y[r] (+)= sum_c W[r, c] act[c], act = silu(gate) * up of one row gu = gate | up [2 cols]: the
        activation computed by each work-group as the GEMV's prologue (gemv_quant_silu), the same values
        silu_mul gives, one launch instead of two."""
        if not self.fuses_silu:
            raise ValueError(f"{self.name}: no fused SiLU GEMV with {self.lanes} lanes per row and {self.cols} columns")
        program = self._dev.build("gemv_quant.cl",
                                  {**kernel_defines(self.fmt), "SILU_COLS": self.cols})
        return bind(program, "gemv_quant_silu", (self.rows,), self._d, self._m, self._q, gu, y, np.int32(self.rows),
                    np.int32(bool(accumulate)), self._y_offset)

    def bind_block_sums(self, x: cl.Buffer, x_sums: cl.Buffer, batch: int) -> Launch:
        """x_sums[b, k] = sum of x[b, 32 k : 32 k + 32], for an x whose producer does not write them."""
        return bind(self._program, "block_sums", (batch, self.cols // 32), x, x_sums, np.int32(self.cols),
                    by_row=True)

    def enqueue_gemv(self, queue: cl.CommandQueue, x: cl.Buffer, y: cl.Buffer, batch: int,
                     accumulate: bool = False) -> None:
        """One-off: the block sums too when the format reads them (never waits)."""
        sums = None
        if self.needs_block_sums:
            sums = cl.Buffer(queue.context, MF.READ_WRITE, batch * (self.cols // 32) * 4)
            self.bind_block_sums(x, sums, batch).enqueue(queue)
        self.bind_gemv(x, y, batch, accumulate, sums).enqueue(queue)

    def bind_embed(self, tokens: cl.Buffer, x: cl.Buffer, n_rows: int) -> Launch:
        """x[r, :] = this[tokens[r], :] dequantized (gguf's values): the embedding lookup, which is
        also the tied LM head, so a tied checkpoint needs no fp32 copy of its embedding."""
        return bind(self._program, "embed_rows", (n_rows,), self._d, self._m, self._q, tokens, x,
                    np.int32(self.cols), by_row=True)


def upload_block_matrix(dev: DeviceContext, t: BlockTensor):
    """A DeviceMatrix in the tensor's own format: QuantMatrix for blocks, dense for F32/F16."""
    if not FORMATS[t.qtype].is_block:
        return upload_dense_matrix(dev, t.dequantize(), "fp32" if t.qtype == "f32" else "fp16")
    return QuantMatrix(dev, t)
