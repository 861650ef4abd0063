"""services/model/gguf_file.py: a GGUF file is parsed once while unchanged, again once it changes."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from services.model.gguf_file import gguf_reader


def write_gguf(path, value: float) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.value", 7)
    w.add_tensor("t", np.full((4, 8), value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_one_parse_while_the_file_is_unchanged_and_another_after_it_changes(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, 1.0)
    first = gguf_reader(path)
    assert gguf_reader(str(path)) is first  # the same file by another spelling: not parsed again
    assert float(first.tensors[0].data[0, 0]) == 1.0
    write_gguf(path, 2.0)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a rewrite within the clock's tick
    again = gguf_reader(path)
    assert again is not first and float(again.tensors[0].data[0, 0]) == 2.0


def test_a_file_that_is_not_gguf_raises_and_is_not_kept(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(Exception):
        gguf_reader(path)
    write_gguf(path, 3.0)
    os.utime(path, ns=(1, 10**18))
    assert float(gguf_reader(path).tensors[0].data[0, 0]) == 3.0


def test_the_reader_gives_what_gguf_py_gives_on_the_default_model(loaded_model):
    """Fields (every value, the tokenizer's arrays included), tensors (name, type, shape, the bytes
    and their layout) exactly as gguf-py's own reader, on the default model's file."""
    path = loaded_model.checkpoint.path
    ours, stock = gguf_reader(path), gguf.GGUFReader(str(path))
    assert type(ours) is not gguf.GGUFReader and not isinstance(ours.data, np.memmap)
    assert list(ours.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        assert ours.fields[name].types == field.types and ours.fields[name].contents() == field.contents(), name
    assert len(ours.tensors) == len(stock.tensors) > 0
    for a, b in zip(ours.tensors, stock.tensors):
        assert (a.name, a.tensor_type, a.n_bytes, a.data_offset) == (b.name, b.tensor_type, b.n_bytes, b.data_offset)
        assert np.array_equal(a.shape, b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
