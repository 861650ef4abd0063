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
from services.model.weights import unpermute_rope_rows

log = logging.getLogger(__name__)

# qtype → (elements per block, bytes per block); f16/f32 are "blocks" of one element
BLOCK_FORMATS = {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34), "f16": (1, 2), "f32": (1, 4)}
_GGML_NAMES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "F16": "f16", "F32": "f32"}


@dataclass(frozen=True, eq=False)
class BlockTensor:
    """One [rows, cols] matrix as GGUF blocks; `raw` is uint8 [rows, row_bytes], read-only."""

    name: str
    qtype: str  # one of BLOCK_FORMATS
    rows: int
    cols: int
    raw: np.ndarray

    def __post_init__(self):
        per_block, block_bytes = BLOCK_FORMATS[self.qtype]
        if self.cols % per_block:
            raise CheckpointError(f"{self.name}: {self.cols} columns is not a whole number of {self.qtype} blocks")
        want = (self.rows, self.cols // per_block * block_bytes)
        if self.raw.dtype != np.uint8 or self.raw.shape != want:
            raise CheckpointError(f"{self.name}: raw blocks {self.raw.dtype}{self.raw.shape}, expected uint8{want}")

    @property
    def n_blocks(self) -> int:
        """Blocks per row."""
        return self.cols // BLOCK_FORMATS[self.qtype][0]

    @property
    def data(self) -> np.ndarray:
        """The raw blocks (gguf's name for them)."""
        return self.raw

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def blocks(self) -> np.ndarray:
        """uint8 [rows, n_blocks, block_bytes]."""
        return self.raw.reshape(self.rows, self.n_blocks, BLOCK_FORMATS[self.qtype][1])

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols], exactly gguf.quants.dequantize's values."""
        return dequantize_rows(self)


def _ggml_type(qtype: str):
    import gguf

    return gguf.GGMLQuantizationType[qtype.upper()]


def dequantize_rows(t: BlockTensor, rows: np.ndarray | slice | None = None) -> np.ndarray:
    """float32 [n, cols] of the given rows (all when None), with gguf's own dequantization."""
    from gguf.quants import dequantize

    raw = t.raw if rows is None else t.raw[rows]
    raw = np.ascontiguousarray(raw.reshape(-1, t.raw.shape[1]))
    if t.qtype == "f32":
        return raw.view(np.float32).copy()
    if t.qtype == "f16":
        return raw.view(np.float16).astype(np.float32)
    return dequantize(raw, _ggml_type(t.qtype)).reshape(-1, t.cols).astype(np.float32, copy=False)


def unpermute_rope(t: BlockTensor, n_heads: int) -> BlockTensor:
    """Q/K rows from llama.cpp's interleaved-pair order to HF's rotate-half order."""
    return BlockTensor(t.name, t.qtype, t.rows, t.cols, np.ascontiguousarray(unpermute_rope_rows(t.raw, n_heads)))


def stack_rows(name: str, parts: list[BlockTensor]) -> BlockTensor:
    """The matrices one under the other ([sum rows, cols]); ValueError unless formats and widths agree."""
    kinds = {(p.qtype, p.cols) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot stack {name}: formats differ or widths differ: {sorted(kinds)}")
    qtype, cols = kinds.pop()
    return BlockTensor(name, qtype, sum(p.rows for p in parts), cols, np.concatenate([p.raw for p in parts]))


class GGUFBlocks:
    """Raw block tensors of a GGUF checkpoint (memory-mapped; nothing is dequantized)."""

    def __init__(self, path: str | Path):
        import gguf

        try:
            self._reader = gguf.GGUFReader(str(path))
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

    def tensor(self, name: str, dense_fallback: bool = False) -> BlockTensor:
        """The tensor's blocks; a type without a device kernel (e.g. Q6_K) raises CheckpointError,
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
                                      f"(supported: {sorted(_GGML_NAMES)})")
            from gguf.quants import dequantize

            log.warning("%s: GGUF type %s has no device kernel; stored as f32", name, t.tensor_type.name)
            dense = np.ascontiguousarray(dequantize(t.data, t.tensor_type).reshape(rows, cols), np.float32)
            return BlockTensor(name, "f32", rows, cols, dense.view(np.uint8))
        raw = np.asarray(t.data).reshape(rows, -1).view(np.uint8)
        return BlockTensor(name, qtype, rows, cols, raw)

    def is_matrix(self, name: str) -> bool:
        return len(self._tensors[name].shape) == 2


def read_block_tensors(ckpt: Checkpoint, cfg: ModelConfig) -> dict[str, BlockTensor]:
    """Every 2-D tensor of a GGUF checkpoint by its GGUF name, q/k rows already un-permuted;
    types without a device kernel come back as f32 (so any GGUF file can use gguf storage)."""
    src = GGUFBlocks.from_checkpoint(ckpt)
    out = {}
    for name in src.names():
        if not src.is_matrix(name):
            continue  # norms and other vectors stay with the dense weights
        t = src.tensor(name, dense_fallback=True)
        if name.endswith("attn_q.weight") and cfg.arch.gguf_rope_permuted:  # (not Qwen's: llama.cpp's neox rope)
            t = unpermute_rope(t, cfg.n_heads)
        elif name.endswith("attn_k.weight") and cfg.arch.gguf_rope_permuted:
            t = unpermute_rope(t, cfg.n_kv_heads)
        out[name] = t
    return out
