"""A GGUF checkpoint's weight matrices as their raw quantized blocks (no dequantization).

The decode engine keeps these blocks on the device and dequantizes inside its
GEMV kernels, so it reads ~5x fewer bytes than fp32 with exactly the weight
values `gguf.quants.dequantize` (and so `transformers`) produces.

A `BlockTensor` is [rows, cols] in GGML's row-major block order: `raw` is uint8
[rows, bytes_per_row], each row is cols/block_size blocks. Q and K rows are
un-permuted to Hugging Face's rotary order like `services.model.weights` does for the
dense weights (that only reorders rows, so it applies to block rows as they are).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.model.checkpoint import Checkpoint, CheckpointError
from services.model.config import ModelConfig
from services.model.formats import FORMATS
from services.model.gguf_file import gguf_reader
from services.model.weights import unpermute_rope_rows

log = logging.getLogger(__name__)

# GGUF type name -> the engine's format name (formats.py: sizes, kernels, layout of each)
_GGML_NAMES = {f.ggml: f.name for f in FORMATS.values()}
SUPPORTED_GGML_TYPES = tuple(_GGML_NAMES)  # the GGUF tensor types the decode engine stores as they are


@dataclass(frozen=True, eq=False)
class BlockTensor:
    """One [rows, cols] matrix as GGUF blocks; `raw` is uint8 [rows, row_bytes], read-only."""

    name: str
    qtype: str  # a name in formats.FORMATS
    rows: int
    cols: int
    raw: np.ndarray
    source: str = ""  # the file's type name (Q4_K, BF16, ...), when the blocks came from one

    def __post_init__(self):
        per_block, block_bytes = FORMATS[self.qtype].per_block, FORMATS[self.qtype].block_bytes
        if self.cols % per_block:
            raise CheckpointError(f"{self.name}: {self.cols} columns is not a whole number of {self.qtype} blocks")
        want = (self.rows, self.cols // per_block * block_bytes)
        if self.raw.dtype != np.uint8 or self.raw.shape != want:
            raise CheckpointError(f"{self.name}: raw blocks {self.raw.dtype}{self.raw.shape}, expected uint8{want}")

    @property
    def n_blocks(self) -> int:
        """Blocks per row."""
        return self.cols // FORMATS[self.qtype].per_block

    @property
    def data(self) -> np.ndarray:
        """The raw blocks (gguf's name for them)."""
        return self.raw

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def blocks(self) -> np.ndarray:
        """uint8 [rows, n_blocks, block_bytes]."""
        return self.raw.reshape(self.rows, self.n_blocks, FORMATS[self.qtype].block_bytes)

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols], exactly gguf.quants.dequantize's values."""
        return dequantize_rows(self)


def _ggml_type(qtype: str):
    import gguf

    return gguf.GGMLQuantizationType[qtype.upper()]


def dequantize_rows(t: BlockTensor, rows: np.ndarray | slice | None = None) -> np.ndarray:
    """float32 [n, cols] of the given rows (all when None), with gguf's own dequantization."""
    from services.model.dequantize import dequantize

    raw = t.raw if rows is None else t.raw[rows]
    raw = np.ascontiguousarray(raw.reshape(-1, t.raw.shape[1]))
    if t.qtype == "f32":
        return raw.view(np.float32).copy()
    if t.qtype == "f16":
        return raw.view(np.float16).astype(np.float32)
    return dequantize(raw, _ggml_type(t.qtype)).reshape(-1, t.cols).astype(np.float32, copy=False)


def unpermute_rope(t: BlockTensor, n_heads: int) -> BlockTensor:
    """Q/K rows from llama.cpp's interleaved-pair order to HF's rotate-half order."""
    return BlockTensor(t.name, t.qtype, t.rows, t.cols, np.ascontiguousarray(unpermute_rope_rows(t.raw, n_heads)),
                       t.source)


def stack_rows(name: str, parts: list[BlockTensor]) -> BlockTensor:
    """The matrices one under the other ([sum rows, cols]); ValueError unless formats and widths agree."""
    kinds = {(p.qtype, p.cols) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot stack {name}: formats differ or widths differ: {sorted(kinds)}")
    qtype, cols = kinds.pop()
    return BlockTensor(name, qtype, sum(p.rows for p in parts), cols, np.concatenate([p.raw for p in parts]),
                       "+".join(dict.fromkeys(p.source for p in parts)))


# formats whose weights are d * (integer in [-128, 127]) with the block's fp16 d: Q8_0 holds them exactly
_SYMMETRIC_32 = tuple(f.name for f in FORMATS.values() if f.symmetric)


def as_q8_0(t: BlockTensor) -> BlockTensor:
    """A Q4_0 or Q5_0 tensor as Q8_0 blocks with the same weights bit for bit (the same fp16 scale d,
    each q - 8 or q - 16 as an int8): so a stack mixing them with Q8_0 (q|k|v of a Q4_K_M file whose
    rows are not multiples of 256) keeps one block format, at 34 bytes a block instead of 18 or 22."""
    if t.qtype == "q8_0":
        return t
    if t.qtype not in _SYMMETRIC_32:
        raise ValueError(f"{t.name}: {t.qtype} weights are not Q8_0 values")
    raw = t.blocks()
    head = 2 if t.qtype == "q4_0" else 6  # d, then Q5_0's fifth bits
    qs = raw[..., head:].astype(np.int16)
    v = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if t.qtype == "q5_0":
        qh = np.ascontiguousarray(raw[..., 2:6]).view("<u4")
        v = v | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4)
    v = (v - (8 if t.qtype == "q4_0" else 16)).astype(np.int8)
    out = np.concatenate([raw[..., :2], v.view(np.uint8)], axis=-1).reshape(t.rows, -1)
    return BlockTensor(t.name, "q8_0", t.rows, t.cols, out, t.source)


def stack_exact(name: str, parts: list[BlockTensor]) -> BlockTensor:
    """stack_rows, after turning Q4_0/Q5_0 parts beside Q8_0 ones into Q8_0 (as_q8_0: the same
    weights); ValueError when the formats still differ."""
    fmts = {p.qtype for p in parts}
    if len(fmts) > 1 and fmts <= set(_SYMMETRIC_32) and "q8_0" in fmts:
        parts = [as_q8_0(p) for p in parts]
    return stack_rows(name, parts)


class GGUFBlocks:
    """Raw block tensors of a GGUF checkpoint (memory-mapped; nothing is dequantized)."""

    def __init__(self, path: str | Path):
        try:
            self._reader = gguf_reader(path)
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"{path}: cannot read GGUF: {exc}") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.path = Path(path)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> "GGUFBlocks":
        if ckpt.kind != "gguf":
            raise CheckpointError(f"{ckpt.path}: block storage needs a GGUF checkpoint, this one is {ckpt.kind!r}")
        return cls(ckpt.path)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """The GGUF type name of a tensor (Q4_K, F32, ...)."""
        return self._tensors[name].tensor_type.name

    def tensor(self, name: str, dense_fallback: bool = False) -> BlockTensor:
        """The tensor's blocks; a type without a device kernel (e.g. Q3_K) raises CheckpointError,
        or with dense_fallback comes back as f32 (gguf's dequantization: same values, 4 bytes each)."""
        if name not in self._tensors:
            raise CheckpointError(f"{self.path.name} has no tensor {name!r}")
        t = self._tensors[name]
        shape = [int(d) for d in reversed(t.shape.tolist())]
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        qtype = _GGML_NAMES.get(t.tensor_type.name)
        if qtype is None:
            if not dense_fallback:
                raise CheckpointError(f"{name}: GGUF type {t.tensor_type.name} has no device kernel "
                                      f"(supported: {', '.join(SUPPORTED_GGML_TYPES)})")
            from services.model.dequantize import dequantize

            log.warning("%s: GGUF type %s has no device kernel; stored as f32", name, t.tensor_type.name)
            dense = np.ascontiguousarray(dequantize(t.data, t.tensor_type).reshape(rows, cols), np.float32)
            return BlockTensor(name, "f32", rows, cols, dense.view(np.uint8), t.tensor_type.name)
        raw = np.asarray(t.data).reshape(rows, -1).view(np.uint8)
        return BlockTensor(name, qtype, rows, cols, raw, t.tensor_type.name)

    def is_matrix(self, name: str) -> bool:
        return len(self._tensors[name].shape) == 2


# unquantized types without a kernel: f32 holds their values exactly, so they need no permission
_EXACT_AS_F32 = ("BF16", "F64")


def read_block_tensors(ckpt: Checkpoint, cfg: ModelConfig,
                       allow_dense_fallback: bool = False) -> dict[str, BlockTensor]:
    """Every 2-D tensor of a GGUF checkpoint by its GGUF name, q/k rows already un-permuted. A
    quantized type without a device kernel is refused (CheckpointError naming it and the supported
    ones) unless allow_dense_fallback, which stores it as f32 (gguf's values, 4 bytes a weight)."""
    src = GGUFBlocks.from_checkpoint(ckpt)
    matrices = [name for name in src.names() if src.is_matrix(name)]  # norms and vectors stay dense
    missing: dict[str, list[str]] = {}
    for name in matrices:
        kind = src.tensor_type(name)
        if kind not in _GGML_NAMES and kind not in _EXACT_AS_F32:
            missing.setdefault(kind, []).append(name)
    if missing and not allow_dense_fallback:
        which = "; ".join(f"{kind} ({len(names)} tensors, e.g. {names[0]})" for kind, names in missing.items())
        raise CheckpointError(
            f"{ckpt.path.name}: GGUF tensor types without a device kernel: {which}. The decode engine serves "
            f"{', '.join(t for t in SUPPORTED_GGML_TYPES)}; set HYBRIDSERVE_DECODE_ALLOW_DENSE_FALLBACK=true to "
            f"store the others as f32 (the same values, 4 bytes a weight)")
    out = {}
    for name in matrices:
        t = src.tensor(name, dense_fallback=True)
        if name.endswith("attn_q.weight") and cfg.arch.gguf_rope_permuted:  # (not Qwen's: llama.cpp's neox rope)
            t = unpermute_rope(t, cfg.n_heads)
        elif name.endswith("attn_k.weight") and cfg.arch.gguf_rope_permuted:
            t = unpermute_rope(t, cfg.n_kv_heads)
        out[name] = t
    return out
