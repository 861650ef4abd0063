"""One parse of a GGUF file per process: gguf-py's reader, kept for the files read lately.

Reading a GGUF header with gguf-py walks every metadata field part by part through numpy views,
and the tokenizer's arrays (49152 tokens and their merges in the default model) make that ~4.6 s on
a 2.1 GHz Xeon, in every process of a stack. Most of it was numpy.memmap's bookkeeping: every one of
the ~250,000 views it cut was a memmap whose __array_finalize__ copies the map's attributes, so
`_PlainViewReader` hands the parser a plain ndarray over the same map (1.6 s; the same fields,
tensors and bytes: tests/model/test_gguf_file.py compares it with the stock reader). An engine's
start read the same file three times (its config, its dense weights, its device blocks): this keeps
the parsed reader, so the second and third are free. The reader maps the file read-only, so
sharing it is safe; a file changed on disk (size or mtime) is parsed again.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

KEPT = 4  # files whose readers are kept (tests read several small checkpoints in one process)


def gguf_reader(path: str | Path):
    """gguf.GGUFReader of `path`, parsed once while the file is unchanged; the reader's own errors
    (ValueError, OSError and others on a truncated or foreign file) pass through."""
    p = os.path.abspath(path)
    st = os.stat(p)
    return _parsed(p, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=KEPT)
def _parsed(path: str, size: int, mtime_ns: int):
    return plain_view_reader()(path)


@functools.cache
def plain_view_reader() -> type:
    """The reader class (a gguf.GGUFReader); the test suite hands it to transformers' GGUF loading too."""
    import gguf
    import numpy as np

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
