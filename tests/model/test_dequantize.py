"""services/model/dequantize.py: gguf-py's values bit for bit for every block format it dequantizes,
whatever the chunk of rows, and its errors for data that is not whole blocks."""
from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants
from gguf.quants import dequantize as gguf_dequantize

from services.model import dequantize as chunked

BLOCK_TYPES = [t for t in GGMLQuantizationType
               if t not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) and t in GGML_QUANT_SIZES
               and hasattr(getattr(quants, t.name, None), "dequantize_rows")]


def random_tensor(qtype, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row] of random blocks. Some scales come out inf or NaN: the arithmetic is
    the same either way, so are the bits (NaN's included), which is what is compared."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    return np.random.default_rng(seed).integers(0, 256, (rows, blocks_per_row * type_size), dtype=np.uint8)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the inf and NaN scales' arithmetic
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_every_format_gives_gguf_pys_bits_whatever_the_chunk(qtype, monkeypatch):
    data = random_tensor(qtype, 37, 3, seed=int(qtype))
    want = gguf_dequantize(data, qtype)
    for chunk in (1 << 20, 100, 1):  # one call, a few rows a call, a row (or less) a call
        monkeypatch.setattr(chunked, "CHUNK_WEIGHTS", chunk)
        got = chunked.dequantize(data, qtype)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_dense_types_are_gguf_pys_and_partial_blocks_are_an_error():
    x = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float16)
    np.testing.assert_array_equal(chunked.dequantize(x.view(np.uint8).reshape(3, 128), GGMLQuantizationType.F16),
                                  gguf_dequantize(x.view(np.uint8).reshape(3, 128), GGMLQuantizationType.F16))
    with pytest.raises(ValueError):
        chunked.dequantize(np.zeros((2, 19), np.uint8), GGMLQuantizationType.Q4_1)  # 19 bytes: not whole blocks
