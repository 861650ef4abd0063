"""services/model/gguf_file.py: a GGUF file is parsed once while unchanged, again once it changes, and
its own header parser gives what gguf-py's reader gives (fields of every value type, tensors of plain
and block types), leaving the files it does not read to gguf-py."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from services.model.gguf_file import GGUFFile, gguf_reader, plain_view_reader
from tests.decode_fpga.kquant_checkpoint import write_tiny_llama


def write_gguf(path, value: float, endianess=gguf.GGUFEndian.LITTLE) -> None:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
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


def same_as_gguf_py(ours, path) -> None:
    stock = gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        assert ours.fields[name].types == field.types and ours.fields[name].contents() == field.contents(), name
    assert len(ours.tensors) == len(stock.tensors) > 0
    for a, b in zip(ours.tensors, stock.tensors):
        assert (a.name, a.tensor_type, a.n_bytes, a.data_offset) == (b.name, b.tensor_type, b.n_bytes, b.data_offset)
        assert np.array_equal(a.shape, b.shape) and a.n_elements == b.n_elements
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


def test_the_reader_gives_what_gguf_py_gives_on_the_default_model(loaded_model):
    """Fields (every value, the tokenizer's arrays included), tensors (name, type, shape, the bytes
    and their layout) exactly as gguf-py's own reader, on the default model's file."""
    path = loaded_model.checkpoint.path
    ours = gguf_reader(path)
    assert type(ours) is GGUFFile and not isinstance(ours.data, np.memmap)
    same_as_gguf_py(ours, path)
    # and the fallback, which services/model/reference.py also hands transformers' GGUF loading
    plain = plain_view_reader()(str(path))
    assert isinstance(plain, gguf.GGUFReader) and not isinstance(plain.data, np.memmap)
    same_as_gguf_py(plain, path)


def test_every_value_type_and_block_types_read_as_gguf_py_reads_them(tmp_path):
    t = gguf.GGUFValueType
    path = write_tiny_llama(tmp_path / "kq.gguf", {"token_embd": "q6_k", "attn_q": "q4_k", "attn_k": "q5_k",
                                                   "attn_v": "q2_k", "attn_output": "q3_k", "ffn_gate": "q5_1",
                                                   "ffn_up": "q5_0", "ffn_down": "q6_k"}, n_layers=1)
    w = gguf.GGUFWriter(str(tmp_path / "values.gguf"), "llama")
    values = {"u8": (255, t.UINT8), "i8": (-128, t.INT8), "u16": (65535, t.UINT16), "i16": (-32768, t.INT16),
              "u32": (2**32 - 1, t.UINT32), "i32": (-2**31, t.INT32), "f32": (0.1, t.FLOAT32), "yes": (True, t.BOOL),
              "no": (False, t.BOOL), "u64": (2**64 - 1, t.UINT64), "i64": (-2**63, t.INT64), "f64": (0.1, t.FLOAT64),
              "text": ("héllo ▁wörld", t.STRING), "empty text": ("", t.STRING)}
    for key, (value, kind) in values.items():
        w.add_key_value(key, value, kind)
    for key, value, sub in (("ints", [1, -2, 3], t.INT32), ("floats", [0.5, 1e-7], t.FLOAT32),
                            ("bools", [True, False], t.BOOL), ("texts", ["a", "", "ü▁"], t.STRING),
                            ("wide", list(range(2**33, 2**33 + 3)), t.UINT64)):
        w.add_key_value(key, value, t.ARRAY, sub_type=sub)
    w.add_tensor("f16", np.arange(12, dtype=np.float16).reshape(3, 4))
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, tmp_path / "values.gguf"):
        ours = gguf_reader(p)
        assert type(ours) is GGUFFile
        same_as_gguf_py(ours, p)


def test_an_empty_array_reads_as_gguf_py_reads_it(tmp_path):
    """gguf-py's writer refuses one, other writers need not: an empty array's types are [ARRAY] alone
    (gguf-py takes the item type from a first item) and its contents []."""
    import struct

    key = b"empty"
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32, 0))
    ours, stock = GGUFFile(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(stock.fields)
    assert ours.fields["empty"].types == stock.fields["empty"].types == [gguf.GGUFValueType.ARRAY]
    assert ours.fields["empty"].contents() == stock.fields["empty"].contents() == []


def test_a_value_that_is_not_utf8_goes_to_gguf_py(tmp_path):
    """gguf-py decodes a value only when asked: such a file reads, and its other fields read, as there."""
    import struct

    path = tmp_path / "bytes.gguf"
    entries = [(b"raw", b"\xff\xfe"), (b"ok", b"fine")]
    body = b"".join(struct.pack("<Q", len(k)) + k + struct.pack("<IQ", gguf.GGUFValueType.STRING, len(v)) + v
                    for k, v in entries)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries)) + body)
    reader = gguf_reader(path)
    assert isinstance(reader, gguf.GGUFReader) and reader.fields["ok"].contents() == "fine"


def test_a_big_endian_file_goes_to_gguf_py(tmp_path):
    path = tmp_path / "be.gguf"
    write_gguf(path, 5.0, gguf.GGUFEndian.BIG)
    reader = gguf_reader(path)
    assert isinstance(reader, gguf.GGUFReader) and reader.fields["test.value"].contents() == 7
    assert float(reader.tensors[0].data[0, 0]) == 5.0


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_a_truncated_file_is_a_value_error(tmp_path, keep):
    """Cut in its header (its fields) or in its tensor data: ValueError, which the loaders turn into
    a CheckpointError naming the file."""
    path = tmp_path / "m.gguf"
    write_gguf(path, 1.0)
    whole = path.read_bytes()
    header = GGUFFile(path).data_offset
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:int(header * keep)] if keep < 0.9 else whole[:-8])
    with pytest.raises(ValueError):
        GGUFFile(cut)
