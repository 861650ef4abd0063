"""transformers' own model of a checkpoint: the numerical reference the engines are held to (the test
suite's and the benchmarks' baseline).

transformers' GGUF loading parses the file twice with gguf-py's reader and builds gguf-py's tensor
name map once per module (397 times for the default model): ~17 s on a 2.1 GHz Xeon, 9 of it numpy
memmap views. Here it gets the same reader over plain views (gguf_file.plain_view_reader: the same
fields and tensors, tests/model/test_gguf_file.py) and one name map per (architecture, layer count),
which it only reads. The dequantization, the name mapping and the model stay transformers' own.
"""
from __future__ import annotations

import functools
from unittest import mock

from services.model.checkpoint import Checkpoint
from services.model.gguf_file import plain_view_reader


def load_reference(ckpt: Checkpoint):
    """transformers' model of `ckpt` (a GGUF file or a Hugging Face directory) in fp32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if ckpt.kind != "gguf":
        return AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=torch.float32).eval()
    import gguf

    with mock.patch.object(gguf, "GGUFReader", plain_view_reader()), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)):
        model = AutoModelForCausalLM.from_pretrained(str(ckpt.path.parent), gguf_file=ckpt.path.name,
                                                     dtype=torch.float32)
    return model.eval()
