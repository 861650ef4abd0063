"""The block-format table (services/model/formats.py) against gguf's own sizes and the kernels' codes."""
from __future__ import annotations

import re

import gguf
import pytest

from services.decode_fpga.device import KERNEL_DIR
from services.model.formats import BLOCK_FORMATS, BY_GGML, FORMATS, block_format, kernel_defines, qfmt_set


@pytest.mark.parametrize("name", list(FORMATS))
def test_sizes_are_ggufs(name):
    f = FORMATS[name]
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[f.ggml]] == (f.per_block, f.block_bytes)
    assert BY_GGML[f.ggml] is f


def test_codes_and_bits_are_distinct_and_known_to_the_kernels():
    blocks = [FORMATS[n] for n in BLOCK_FORMATS]
    assert len({f.code for f in blocks}) == len(blocks) and len({f.bit for f in blocks}) == len(blocks)
    header = (KERNEL_DIR / "quant_blocks.h").read_text()
    listed = {int(c) for c in re.findall(r"^//\s+(\d\d) Q", header, re.M)}
    listed |= {int(c) for c in re.findall(r"\s(\d\d) Q\d_\w", header)}
    assert {f.code for f in blocks} <= listed
    # decode_layers.cl instantiates a format per bit of QFMT_SET, by the same bit numbers
    layers = (KERNEL_DIR / "decode_layers.cl").read_text()
    for f in blocks:
        assert re.search(rf"HAS_QFMT\({f.code}, {f.bit}\)", layers), f.name


def test_helpers_refuse_what_is_not_a_block_format():
    assert kernel_defines("q4_k") == {"QFMT": 42}
    assert qfmt_set(["q4_1", "q8_0", "q4_1"]) == 0b110  # bits 1 and 2
    with pytest.raises(ValueError):
        kernel_defines("f16")
    with pytest.raises(KeyError, match="q3_k"):
        block_format("q3_k")
