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
