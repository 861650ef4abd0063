"""The one table of GGUF block formats: what the loader, the GEMV launcher and the kernels' build flags read.

A row per format the decode engine stores as it is in the file. Adding a format is a row here, its
repack in decode_fpga/quant_gemv.py (split_blocks) and its arithmetic in kernels/quant_blocks.h
under the same `code`; everything that lists, sizes or selects formats reads this table.

Fields:
  name        the engine's name (BlockTensor.qtype), the lower-case GGML type name
  ggml        the GGUF tensor type's name (Q4_K, F16, ...)
  per_block   weights a block of the file holds (the K-quants' super-blocks: 256; f16/f32: 1)
  block_bytes bytes a block of the file takes
  code        the format's code in the kernels (QFMT, quant_blocks.h); 0: no block kernel (dense)
  bit         its bit in decode_layers.cl's QFMT_SET (the formats a model's packed layers hold)
  has_mins    weights d q + m: the one-row GEMVs add sum_b m_b * (sum of x over block b)
  repack      how split_blocks lays it out on the device: "split" (the blocks' own quants after
              their scales), "q4" (repacked to 32-weight nibble blocks, K: with byte scales),
              "q5" (q4 plus the fifth bits), "q6" (Q6_K's 24 bytes a block), "dense"
  symmetric   weights are d * (an integer in [-128, 127]): Q8_0 holds them exactly (as_q8_0)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml: str
    per_block: int
    block_bytes: int
    code: int
    bit: int
    has_mins: bool
    repack: str
    symmetric: bool = False

    @property
    def is_block(self) -> bool:
        """Whether the GEMV kernels read it as blocks (not a dense f16/f32 matrix)."""
        return self.code != 0

    @property
    def bits_per_weight(self) -> float:
        """In the file."""
        return 8 * self.block_bytes / self.per_block


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("q4_0", "Q4_0", 32, 18, 40, 0, False, "split", symmetric=True),
    BlockFormat("q4_1", "Q4_1", 32, 20, 41, 1, True, "split"),
    BlockFormat("q8_0", "Q8_0", 32, 34, 80, 2, False, "split", symmetric=True),
    BlockFormat("q5_0", "Q5_0", 32, 22, 50, 3, False, "q5", symmetric=True),
    BlockFormat("q5_1", "Q5_1", 32, 24, 51, 4, True, "q5"),
    BlockFormat("q4_k", "Q4_K", 256, 144, 42, 5, True, "q4"),
    BlockFormat("q5_k", "Q5_K", 256, 176, 52, 6, True, "q5"),
    BlockFormat("q6_k", "Q6_K", 256, 210, 62, 7, False, "q6"),
    BlockFormat("f16", "F16", 1, 2, 0, -1, False, "dense"),
    BlockFormat("f32", "F32", 1, 4, 0, -1, False, "dense"),
)}
BY_GGML: dict[str, BlockFormat] = {f.ggml: f for f in FORMATS.values()}
BLOCK_FORMATS = tuple(f.name for f in FORMATS.values() if f.is_block)  # the formats with a block kernel


def block_format(name: str) -> BlockFormat:
    """The row of a block format (KeyError naming the known ones otherwise)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a known format ({', '.join(FORMATS)})") from None


def kernel_defines(name: str) -> dict[str, int]:
    """The build flags of a one-format kernel program (gemv_quant.cl, gemv_quant_wg.cl)."""
    f = block_format(name)
    if not f.is_block:
        raise ValueError(f"{name} has no block kernel")
    return {"QFMT": f.code}


def qfmt_set(names) -> int:
    """decode_layers.cl's QFMT_SET: a bit per block format of `names`."""
    return sum(1 << block_format(n).bit for n in set(names))
