"""The versioned header in front of one request's KV, whatever carries it.

A fixed binary record (no pickle), padded to `HEADER_SIZE` bytes: magic, version,
layout, wire dtype, the model's KV shape, the prompt's token count, the model id.
The receiver builds the header it expects from its own request and model and
checks every field: a mismatch is `HeaderMismatch`, never garbage tokens.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from services.kv.layout import WIRE_DTYPES

MAGIC = b"HSKV"
VERSION = 1
LAYOUT_LAYER_KV_HEAD_TOKEN_DIM = 1
HEADER = struct.Struct("<4sHHBxHHHI32s")  # magic version layout dtype n_layers n_kv_heads head_dim n_tokens model
HEADER_SIZE = 64  # bytes before the KV data; HEADER.size rounded up, room for a later version


class HeaderMismatch(ValueError):
    """What arrived does not describe what the receiver expects (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class SlotHeader:
    dtype: str  # a WIRE_DTYPES name
    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_tokens: int
    model_id: str
    version: int = VERSION
    layout: int = LAYOUT_LAYER_KV_HEAD_TOKEN_DIM

    def pack(self) -> bytes:
        raw = HEADER.pack(MAGIC, self.version, self.layout, WIRE_DTYPES[self.dtype].code, self.n_layers,
                          self.n_kv_heads, self.head_dim, self.n_tokens, self.model_id.encode()[:32])
        return raw.ljust(HEADER_SIZE, b"\0")

    @classmethod
    def unpack(cls, raw: bytes) -> "SlotHeader":
        magic, version, layout, code, n_layers, n_kv, head_dim, n_tokens, model = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise HeaderMismatch(f"slot header magic {magic!r} is not {MAGIC!r}: not a KV slot")
        names = {d.code: d.name for d in WIRE_DTYPES.values()}
        return cls(names.get(code, f"unknown({code})"), n_layers, n_kv, head_dim, n_tokens,
                   model.rstrip(b"\0").decode(errors="replace"), version, layout)

    def check_against(self, expected: "SlotHeader") -> None:
        """Raise HeaderMismatch naming every field that differs from `expected`."""
        order = ("version", "layout", "dtype", "n_layers", "n_kv_heads", "head_dim", "n_tokens", "model_id")
        diffs = [f"{f}={getattr(self, f)!r} (expected {getattr(expected, f)!r})"
                 for f in order if getattr(self, f) != getattr(expected, f)]
        if diffs:
            raise HeaderMismatch("KV slot header mismatch: " + ", ".join(diffs))
