"""One parse of a GGUF file per process, kept for the files read lately, and a header parser that does
not cut a numpy view per value.

gguf-py's reader walks every metadata field part by part through numpy views: the tokenizer's arrays
(49152 tokens and their merges in the default model) made that ~4.6 s on a 2.1 GHz Xeon, in every
process of a stack. `_PlainViewReader` (the reader over a plain ndarray, not a memmap whose every view
copies the map's attributes) took it to ~1.6 s, still the largest part of an engine's start after
torch's import. `GGUFFile` reads the same header with `struct` and one `numpy.frombuffer` per numeric
array, the tokenizer's strings decoded in one loop (~0.1 s): the same fields (their GGUFValueType
list and `contents()`) and tensors (gguf.ReaderTensor, data viewing the same map) as gguf-py gives,
which tests/model/test_gguf_file.py checks on the default model and the test checkpoints. A file it
does not read (big-endian, arrays of arrays, string values that are not UTF-8) goes to gguf-py's
reader instead.

An engine's start read the same file three times (its config, its dense weights, its device blocks):
the parsed file is kept, so the second and third are free. It is mapped read-only, so sharing it is
safe; a file changed on disk (size or mtime) is parsed again.
"""
from __future__ import annotations

import functools
import os
import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np

KEPT = 4  # files whose readers are kept (tests read several small checkpoints in one process)
GGUF_MAGIC = b"GGUF"
# GGUFValueType codes and how each scalar is stored (little-endian)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# the GGML types gguf-py reads as numpy arrays of their own dtype; the others as bytes [rows, row bytes]
_PLAIN_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


def gguf_reader(path: str | Path):
    """The parsed GGUF file at `path` (a GGUFFile, or gguf-py's reader for a file GGUFFile does not
    read), parsed once while the file is unchanged; a truncated or foreign file raises ValueError
    (or OSError, or gguf-py's own errors)."""
    p = os.path.abspath(path)
    st = os.stat(p)
    return _parsed(p, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=KEPT)
def _parsed(path: str, size: int, mtime_ns: int):
    try:
        return GGUFFile(path)
    except _NotRead:
        return plain_view_reader()(path)


class _NotRead(Exception):
    """A valid layout GGUFFile leaves to gguf-py."""


class GGUFField:
    """One metadata value: its GGUFValueType list (an array's: ARRAY, then its items' type, as gguf-py
    lists them) and its value, as gguf-py's ReaderField.contents() gives it."""

    __slots__ = ("types", "_value")

    def __init__(self, types: list, value):
        self.types, self._value = types, value

    def contents(self):
        return list(self._value) if isinstance(self._value, list) else self._value


class GGUFFile:
    """A GGUF file's fields (name -> GGUFField, in file order, after gguf-py's GGUF.version,
    GGUF.tensor_count and GGUF.kv_count) and tensors (gguf.ReaderTensor over the read-only map)."""

    def __init__(self, path: str | Path):
        import gguf
        from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

        self.data = np.asarray(np.memmap(path, mode="r"))  # a plain ndarray over the map (see above)
        self._buf = memoryview(self.data)
        try:
            if bytes(self._buf[:4]) != GGUF_MAGIC:
                raise ValueError("GGUF magic invalid")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._buf, 4)
            if version & 0xFFFF == 0:
                raise _NotRead("a GGUF file of the other byte order")
            if version not in READER_SUPPORTED_VERSIONS:
                raise ValueError(f"GGUF version {version} is not supported ({READER_SUPPORTED_VERSIONS})")
            t = gguf.GGUFValueType
            self.fields: OrderedDict[str, GGUFField] = OrderedDict(
                (name, GGUFField([kind], value)) for name, kind, value in
                (("GGUF.version", t.UINT32, version), ("GGUF.tensor_count", t.UINT64, n_tensors),
                 ("GGUF.kv_count", t.UINT64, n_kv)))
            offs = 24
            for _ in range(n_kv):
                name, offs = self._string(offs)
                (kind,), offs = struct.unpack_from("<I", self._buf, offs), offs + 4
                if name in self.fields:
                    raise KeyError(f"duplicate GGUF key {name}")
                types, value, offs = self._value(kind, offs)
                self.fields[name] = GGUFField(types, value)
            infos = []
            for _ in range(n_tensors):
                name, offs = self._string(offs)
                (n_dims,), offs = struct.unpack_from("<I", self._buf, offs), offs + 4
                dims = np.frombuffer(self.data, np.uint64, n_dims, offs)
                offs += 8 * n_dims
                raw_type, tensor_offset = struct.unpack_from("<IQ", self._buf, offs)
                offs += 12
                infos.append((name, dims, raw_type, tensor_offset))
            align = self.fields.get("general.alignment")
            alignment = gguf.GGUF_DEFAULT_ALIGNMENT
            if align is not None:
                if align.types != [t.UINT32]:
                    raise ValueError("Bad type for general.alignment field")
                alignment = align.contents()
                if alignment == 0 or alignment & (alignment - 1):
                    raise ValueError("Invalid alignment: must be a non-zero power of two")
            self.data_offset = offs + (-offs % alignment)
            self.tensors = [self._tensor(*info) for info in infos]
            if len({x.name for x in self.tensors}) != len(self.tensors):
                raise ValueError("duplicated tensor names")
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"truncated or corrupt GGUF header: {exc}") from exc

    def _string(self, offs: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, offs)
        end = offs + 8 + n
        if end > len(self._buf):
            raise ValueError("a string runs past the end of the file")
        return str(self._buf[offs + 8:end], "utf-8"), end

    def _value_string(self, offs: int) -> tuple[str, int]:
        """A string value: gguf-py decodes one only when asked for it, so a file whose values are not
        all UTF-8 (a vocabulary of raw bytes) is left to it, to behave as it does."""
        try:
            return self._string(offs)
        except UnicodeDecodeError as exc:
            raise _NotRead(f"a string value that is not UTF-8: {exc}") from exc

    def _value(self, kind: int, offs: int) -> tuple[list, object, int]:
        from gguf import GGUFValueType as t
        if kind == _STRING:
            value, offs = self._value_string(offs)
            return [t.STRING], value, offs
        if kind in _SCALARS:
            fmt = "<" + _SCALARS[kind]
            (value,) = struct.unpack_from(fmt, self._buf, offs)
            return [t(kind)], value, offs + struct.calcsize(fmt)
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = struct.unpack_from("<IQ", self._buf, offs)
        offs += 12
        if count == 0:
            return [t.ARRAY], [], offs  # gguf-py lists an item type only from a first item
        if item == _STRING:
            values = []
            for _ in range(count):
                s, offs = self._value_string(offs)
                values.append(s)
            return [t.ARRAY, t.STRING], values, offs
        if item not in _SCALARS:
            raise _NotRead(f"an array of GGUF type {item}")
        dtype = np.dtype("<" + _SCALARS[item])
        values = np.frombuffer(self.data, dtype, count, offs).tolist()
        return [t.ARRAY, t(item)], values, offs + dtype.itemsize * count

    def _tensor(self, name: str, dims: np.ndarray, raw_type: int, tensor_offset: int):
        """gguf.ReaderTensor as gguf-py's reader builds it: plain types as their numpy dtype, block
        types as bytes shaped [rows, bytes a row]."""
        import gguf
        from gguf.quants import quant_shape_to_byte_shape

        qtype = gguf.GGMLQuantizationType(raw_type)
        n_elements = int(np.prod(dims))
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * type_size // block
        np_dims = tuple(reversed(dims.tolist()))
        plain = _PLAIN_DTYPES.get(qtype.name)
        if plain is None:
            dtype, count, np_dims = np.uint8, n_bytes, quant_shape_to_byte_shape(np_dims, qtype)
        else:
            dtype, count = plain, n_elements
        start = self.data_offset + tensor_offset
        if start + n_bytes > len(self.data):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = np.frombuffer(self.data, dtype, count, start).reshape(np_dims)
        return gguf.ReaderTensor(name=name, tensor_type=qtype, shape=dims, n_elements=n_elements, n_bytes=n_bytes,
                                 data_offset=start, data=data, field=None)


@functools.cache
def plain_view_reader() -> type:
    """gguf.GGUFReader over a plain ndarray: what this module falls back on, and what reference.py
    hands transformers' GGUF loading."""
    import gguf

    class _PlainViewReader(gguf.GGUFReader):
        """gguf.GGUFReader whose `data` (set to the file's np.memmap by its constructor) reads back as
        a plain ndarray over the same map: the views cut from it are cheap ndarrays, and the map stays
        open as their base."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = np.asarray(value)

    return _PlainViewReader
