"""The model's weights on the device (DeviceWeights), one builder per storage format.

A storage format is how the layer matrices and the LM head sit in device memory;
the launch plans only bind their GEMVs (gemv.py's DeviceMatrix), so every format
serves the same forward:

    fp32, fp16  dense_weights: the host weights, one buffer per matrix (gemv.py)
    gguf        gguf_weights: the checkpoint's own blocks (quant_gemv.py: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
                Q4_K, Q5_K, Q6_K; a q|k|v or gate|up of mixed formats as its parts,
                stacked_matrix.py); on a CPU device that runs a step's layers as one launch,
                every layer packed into one buffer

A new format is a builder here returning DeviceWeights, its branch in
build_device_weights and its name in WEIGHT_FORMATS (and in the settings'
Literal). Every format keeps the norms, the final norm and the RoPE frequencies
in fp32.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
import pyopencl as cl

from services.decode_fpga.arch_parts import ArchVectors
from services.decode_fpga.device import DeviceContext
from services.decode_fpga.gemv import DeviceMatrix, upload_dense_matrix
from services.decode_fpga.packed_arrays import PackedArrays
from services.decode_fpga.quant_gemv import (QFMT_BITS, QFMT_CODES, QuantMatrix, split_blocks,
                                              upload_block_matrix)
from services.decode_fpga.stacked_matrix import StackedMatrix
from services.model.config import ModelConfig
from services.model.checkpoint import CheckpointError
from services.model.gguf_blocks import BlockTensor, stack_exact
from services.model.weights import ModelWeights

log = logging.getLogger(__name__)

MF = cl.mem_flags
WEIGHT_FORMATS = ("fp32", "fp16", "gguf")  # each has a builder below
MATRICES = ("qkv", "o", "gate_up", "down")  # a layer's matrices, in decode_layers.cl's table order
# the GGUF tensors each matrix stacks, one under the other
GGUF_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
              "down": ("ffn_down",)}


@dataclass(frozen=True)
class DeviceLayer:
    attn_norm: cl.Buffer  # [hidden] fp32
    ffn_norm: cl.Buffer  # [hidden] fp32
    qkv: DeviceMatrix  # [q_dim + 2 kv_dim, hidden]
    o: DeviceMatrix  # [hidden, q_dim]
    gate_up: DeviceMatrix  # [2 ff, hidden]
    down: DeviceMatrix  # [hidden, ff]


@dataclass(frozen=True)
class PackedLayers:
    """Every layer's norms and block arrays in one buffer (decode_layers.cl reads them through a table)."""

    arrays: PackedArrays
    # int32 [n_layers, 2 + 4 * len(MATRICES)]: byte offsets of each layer's arrays, then each matrix's
    # format code (QFMT_CODES)
    table: cl.Buffer
    qfmts: tuple[str, ...]  # the block formats the layer matrices hold

    @property
    def qfmt_set(self) -> int:
        """decode_layers.cl's QFMT_SET: a bit per format held (QFMT_BITS)."""
        return sum(1 << QFMT_BITS[f] for f in self.qfmts)


@dataclass(frozen=True)
class DeviceWeights:
    fmt: str  # the storage format (WEIGHT_FORMATS)
    layers: list[DeviceLayer]
    embed: DeviceMatrix  # [vocab, hidden]: rows looked up (bind_embed); the LM head itself when tied
    lm_head: DeviceMatrix  # [vocab, hidden]
    final_norm: cl.Buffer  # [hidden] fp32
    inv_freq: cl.Buffer  # [head_dim / 2] fp32: RoPE's inverse frequencies
    packed: PackedLayers | None = None  # set when the layers also sit in one buffer for decode_layers.cl
    arch: ArchVectors | None = None  # the architecture's biases, extra norms, position table (arch_parts.py)
    # what each GGUF matrix is stored as on the device: name → (its type in the file, the device format);
    # empty for the dense formats
    stored: dict[str, tuple[str, str]] = field(default_factory=dict, kw_only=True)

    def stored_types(self) -> dict[str, int]:
        """GGUF matrices per device format ("q4_k", "q8_0", "f32", ...); the layers' matrix count
        under the dense formats (every one in `fmt`)."""
        if not self.stored:
            return {self.fmt: len(self.layers) * len(MATRICES) + (1 if self.lm_head is self.embed else 2)}
        return dict(Counter(dev for _, dev in self.stored.values()))

    def storage_summary(self) -> str:
        """One line: each (file type → device format) pair and its count, for the start-up log."""
        if not self.stored:
            return f"every matrix {self.fmt}"
        pairs = Counter(f"{src}→{dev}" for src, dev in self.stored.values())
        return ", ".join(f"{pair} x{n}" for pair, n in sorted(pairs.items()))

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads: every layer matrix, the LM head, the norms (not the lookup table)."""
        mats = sum(getattr(layer, k).nbytes for layer in self.layers for k in MATRICES)
        hidden = self.lm_head.cols
        extra = self.arch.nbytes if self.arch is not None else 0
        return mats + self.lm_head.nbytes + (2 * len(self.layers) + 1) * hidden * 4 + extra


def upload_vector(dev: DeviceContext, a: np.ndarray) -> cl.Buffer:
    return cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(a, np.float32))


def _device_weights(dev: DeviceContext, cfg: ModelConfig, w: ModelWeights, fmt: str, layers: list[DeviceLayer],
                    embed: DeviceMatrix, lm_head: DeviceMatrix, packed: PackedLayers | None = None) -> DeviceWeights:
    """The matrices with what every format keeps in fp32: the final norm, the RoPE frequencies (the
    config's: scaling applied, transformers' values bit for bit) and the architecture's vectors."""
    return DeviceWeights(fmt, layers, embed, lm_head, upload_vector(dev, w.final_norm),
                         upload_vector(dev, cfg.inv_freq()), packed, ArchVectors.upload(dev, w))


# ---- fp32 / fp16 ------------------------------------------------------------------------------
def dense_weights(dev: DeviceContext, cfg: ModelConfig, w: ModelWeights, fmt: str) -> DeviceWeights:
    """Every matrix as `fmt` (fp32 or fp16) in a buffer of its own; the embedding is the LM head when tied."""
    if not w.has_matrices:
        raise ValueError(f"{fmt} storage uploads the fp32 matrices, and these weights were loaded without them "
                         "(load_model(gguf_matrices=False))")
    layers = [DeviceLayer(attn_norm=upload_vector(dev, lw.attn_norm), ffn_norm=upload_vector(dev, lw.ffn_norm),
                          qkv=upload_dense_matrix(dev, np.concatenate([lw.wq, lw.wk, lw.wv]), fmt),
                          o=upload_dense_matrix(dev, lw.wo, fmt),
                          gate_up=upload_dense_matrix(dev, np.concatenate([m for m in (lw.w_gate, lw.w_up)
                                                                           if m is not None]), fmt),
                          down=upload_dense_matrix(dev, lw.w_down, fmt))
              for lw in w.layers]
    embed = upload_dense_matrix(dev, w.embed, fmt)
    lm_head = embed if w.lm_head is w.embed else upload_dense_matrix(dev, w.lm_head, fmt)
    return _device_weights(dev, cfg, w, fmt, layers, embed, lm_head)


# ---- gguf blocks --------------------------------------------------------------------------------
LayerTensor = BlockTensor | list[BlockTensor] | np.ndarray  # one format, parts in their own (mixed), dense


def gguf_layer_tensors(blocks: dict[str, BlockTensor], layer: int,
                       allow_dense_fallback: bool = True) -> dict[str, LayerTensor]:
    """Layer `layer`'s MATRICES from the checkpoint's blocks (gguf_blocks.read_block_tensors: q/k rows
    already un-permuted), q|k|v and gate|up stacked (Q4_0/Q5_0 parts beside Q8_0 ones as Q8_0, the
    same weights: gguf_blocks.stack_exact). A stack whose block formats still differ (a Q4_K_M file's
    Q4_K q, k beside a Q6_K v) comes back as its parts, each kept in its own format
    (stacked_matrix.py). A stack with a part in no block format comes back dense (fp32 [rows, cols],
    gguf's values exactly) when allow_dense_fallback, else raises CheckpointError."""
    out: dict[str, LayerTensor] = {}
    for key, names in GGUF_PARTS.items():
        parts = [blocks[f"blk.{layer}.{n}.weight"] for n in names]
        try:
            out[key] = parts[0] if len(parts) == 1 else stack_exact(names[0], parts)
        except ValueError as exc:
            if all(p.qtype in QFMT_CODES for p in parts):  # mixed block formats: each part its own
                log.info("layer %d %s: %s; each part kept in its own format, one GEMV launch per part",
                         layer, "|".join(names), "+".join(p.qtype for p in parts))
                out[key] = parts
                continue
            if not allow_dense_fallback:  # a part in no block format: that stack exact only as dense fp32
                raise CheckpointError(f"layer {layer}: {exc}; the device stacks {'|'.join(names)} in one format. "
                                      f"Set HYBRIDSERVE_DECODE_ALLOW_DENSE_FALLBACK=true to store it as f32") from exc
            log.warning("layer %d %s: %s; storing it as fp32", layer, names, exc)
            out[key] = np.concatenate([p.dequantize() for p in parts])
    return out


def _stored(blocks: dict[str, BlockTensor], tensors: list[dict], lm_head: BlockTensor) -> dict[str, tuple[str, str]]:
    """Each GGUF matrix the engine reads → (its type in the file, its format on the device)."""
    out = {}
    for layer, ts in enumerate(tensors):
        for key, names in GGUF_PARTS.items():
            for i, n in enumerate(names):
                name = f"blk.{layer}.{n}.weight"
                t = ts[key][i] if isinstance(ts[key], list) else ts[key]
                dev = getattr(t, "qtype", "f32")  # a dense stack is an ndarray
                out[name] = (blocks[name].source or blocks[name].qtype, dev)
    for t in {id(lm_head): lm_head, id(blocks["token_embd.weight"]): blocks["token_embd.weight"]}.values():
        out[t.name] = (t.source or t.qtype, t.qtype)
    return out


def gguf_lm_head_tensor(blocks: dict[str, BlockTensor]) -> BlockTensor:
    """The output matrix; the embedding itself when the checkpoint ties them (no output.weight)."""
    return blocks.get("output.weight", blocks["token_embd.weight"])


def gguf_weights(dev: DeviceContext, cfg: ModelConfig, w: ModelWeights, blocks: dict[str, BlockTensor],
                 pack_layers: bool, allow_dense_fallback: bool = True) -> DeviceWeights:
    """Layer matrices, the LM head and the embedding as the checkpoint's blocks (quant_gemv.py).
    pack_layers (a CPU device that runs a step's layers as one launch): when every layer matrix is in
    one block format (any mix of them between matrices: decode_layers.cl reads each matrix's from its
    table), the layers are packed into one buffer, the matrices sub-buffers of it, so they are on the
    device once. A stack of mixed formats (StackedMatrix) is not packed: its steps run launch by launch.
    allow_dense_fallback: see gguf_layer_tensors."""
    tensors = [gguf_layer_tensors(blocks, i, allow_dense_fallback) for i in range(len(w.layers))]
    fmts = {getattr(t, "qtype", None) for ts in tensors for t in ts.values()}
    packed = None
    if pack_layers and fmts <= set(QFMT_CODES):
        layers, packed = _pack_layers(dev, w, tensors)
    else:
        mixed = sum(isinstance(t, list) for ts in tensors for t in ts.values())
        if pack_layers and mixed:
            log.warning("%d layer stacks hold parts of mixed block formats: decode steps run launch by launch, "
                        "not as one launch", mixed)

        def mat(t: LayerTensor) -> DeviceMatrix:
            if isinstance(t, list):
                return StackedMatrix(dev, t)
            return upload_dense_matrix(dev, t, "fp32") if isinstance(t, np.ndarray) else upload_block_matrix(dev, t)

        layers = [DeviceLayer(attn_norm=upload_vector(dev, lw.attn_norm), ffn_norm=upload_vector(dev, lw.ffn_norm),
                              **{k: mat(t) for k, t in ts.items()}) for lw, ts in zip(w.layers, tensors)]
    head_blocks = gguf_lm_head_tensor(blocks)
    lm_head = upload_block_matrix(dev, head_blocks)
    # tied: rows are looked up from the same blocks; else from the embedding's own (gguf's values exactly)
    embed = lm_head if w.lm_head is w.embed else upload_block_matrix(dev, blocks["token_embd.weight"])
    weights = _device_weights(dev, cfg, w, "gguf", layers, embed, lm_head, packed)
    return replace(weights, stored=_stored(blocks, tensors, head_blocks))


def _pack_layers(dev: DeviceContext, w: ModelWeights,
                 tensors: list[dict[str, BlockTensor]]) -> tuple[list[DeviceLayer], PackedLayers]:
    """Every layer's norms and block arrays in one buffer (packed_arrays.py), in the order of
    decode_layers.cl's table; the DeviceLayer matrices are sub-buffers of the same memory."""
    arrays = []
    splits = [{k: split_blocks(ts[k]) for k in MATRICES} for ts in tensors]  # once: packed, then measured
    for lw, split in zip(w.layers, splits):
        arrays += [np.ascontiguousarray(lw.attn_norm, np.float32), np.ascontiguousarray(lw.ffn_norm, np.float32)]
        for k in MATRICES:
            d, m, q = split[k]
            arrays += [d, m if m is not None else d[:, :0], q]  # an empty stand-in where there are no minimums
    packed = PackedArrays(dev, arrays)
    per = 2 + 3 * len(MATRICES)
    table = np.array(packed.offsets, np.int64).reshape(len(w.layers), per)
    if table.max() >= 2 ** 31:
        raise ValueError("the packed layer weights exceed 2 GB; decode_layers indexes them with int")
    codes = np.array([[QFMT_CODES[ts[k].qtype] for k in MATRICES] for ts in tensors], np.int64)
    layers = []
    for li, ts in enumerate(tensors):
        views = packed.views[li * per:(li + 1) * per]
        mats = {}
        for j, k in enumerate(MATRICES):
            d_buf, m_buf, q_buf = views[2 + 3 * j:5 + 3 * j]
            mats[k] = QuantMatrix(dev, ts[k], (d_buf, m_buf if splits[li][k][1] is not None else None, q_buf),
                                  split=splits[li][k])
        layers.append(DeviceLayer(attn_norm=views[0], ffn_norm=views[1], **mats))
    table_buf = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR,
                          hostbuf=np.concatenate([table, codes], axis=1).astype(np.int32))
    fmts = tuple(sorted({ts[k].qtype for ts in tensors for k in MATRICES}))
    return layers, PackedLayers(packed, table_buf, fmts)


# ---- by format ----------------------------------------------------------------------------------
def build_device_weights(dev: DeviceContext, cfg: ModelConfig, w: ModelWeights, fmt: str,
                         blocks: dict[str, BlockTensor] | None = None, pack_layers: bool = False,
                         allow_dense_fallback: bool = True) -> DeviceWeights:
    """The weights in storage format `fmt` (one of WEIGHT_FORMATS). blocks: the checkpoint's blocks
    (gguf_blocks.read_block_tensors), which gguf needs; pack_layers, allow_dense_fallback: see gguf_weights."""
    if fmt in ("fp32", "fp16"):
        return dense_weights(dev, cfg, w, fmt)
    if fmt == "gguf":
        if blocks is None:
            raise ValueError("weights_dtype gguf needs the checkpoint's blocks (gguf_blocks.read_block_tensors)")
        return gguf_weights(dev, cfg, w, blocks, pack_layers, allow_dense_fallback)
    raise ValueError(f"no device weights builder for {fmt!r} (known: {WEIGHT_FORMATS})")
