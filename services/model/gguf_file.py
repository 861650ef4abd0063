"""One parse of a GGUF file per process: gguf-py's reader, kept for the files read lately.

Reading a GGUF header with gguf-py walks every metadata field part by part through numpy views,
and the tokenizer's arrays (49152 tokens and their merges in the default model) make that ~3 s on a
2.1 GHz Xeon. An engine's start read the same file three times (its config, its dense weights,
its device blocks): this keeps the parsed reader, so the second and third are free. The reader
memory-maps the file and is only read from, so sharing it is safe; a file changed on disk (size or
mtime) is parsed again.
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
    import gguf

    return gguf.GGUFReader(path)
