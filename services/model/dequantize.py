"""gguf-py's dequantization, in large chunks of rows.

`gguf.quants.dequantize` runs each format's block arithmetic over groups of 16 rows: ~13,000 calls
for the default model, which prefill_gpu dequantizes whole at every start. The arithmetic is element
by element, so running the same format's `dequantize_rows` over groups of 256K weights gives the same
values bit for bit (tests/model/test_dequantize.py holds every format to it): the default model's
tensors in 0.94-0.99 s of CPU against 1.36-1.81 s (4 alternating runs; groups of 4M weights took
1.8 s, their temporaries past the caches).
"""
from __future__ import annotations

import numpy as np

CHUNK_WEIGHTS = 1 << 18  # weights per call: ~1 MB of fp32 for each temporary


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """float32 values of a GGUF tensor's data (`ReaderTensor.data`, its `tensor_type`), as
    `gguf.quants.dequantize` gives them."""
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    cls = getattr(quants, qtype.name, None)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or not hasattr(cls, "dequantize_rows"):
        return quants.dequantize(data, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = data.view(np.uint8).reshape(-1, data.shape[-1])
    per_row = rows.shape[1] // type_size * block_size
    step = max(1, CHUNK_WEIGHTS // max(per_row, 1))
    cls.init_grid()  # the IQ formats' lookup tables, as gguf's own path makes them first
    out = np.empty((rows.shape[0], per_row), np.float32)
    for i in range(0, rows.shape[0], step):
        out[i:i + step] = cls.dequantize_rows(rows[i:i + step])
    return out.reshape(quants.quant_shape_from_byte_shape(data.shape, qtype))
