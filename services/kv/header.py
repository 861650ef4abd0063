"""The versioned header in front of one request's KV, whatever carries it.

A fixed binary record (no pickle), `HEADER_SIZE` bytes: magic, version, layout,
wire dtype, the model's KV shape, the prompt's token count, the model id, the
request's nonce and the slot's generation. The receiver builds the header it
expects from its own request and model and checks every field: a mismatch is
`HeaderMismatch`, never garbage tokens.

The nonce ties the KV to one request: both sides derive it from the request id
(`request_nonce`), so a slot written for another request (or left in an arena
from before a restart) never passes. The generation is the arena's count of
slots handed out, stamped when the slot was allocated and zeroed when it is
freed: a reader that sees it unchanged after copying a layer knows the slot was
neither freed nor given to another request meanwhile (seqlock style).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from services.kv.layout import WIRE_DTYPES

MAGIC = b"HSKV"
VERSION = 2  # 2: nonce and generation
LAYOUT_LAYER_KV_HEAD_TOKEN_DIM = 1
# magic version layout dtype n_layers n_kv_heads head_dim n_tokens model nonce generation
HEADER = struct.Struct("<4sHHBxHHHI32sQI")
HEADER_SIZE = 64  # bytes before the KV data
if HEADER.size > HEADER_SIZE:
    raise ImportError(f"the slot header ({HEADER.size} bytes) outgrew HEADER_SIZE ({HEADER_SIZE})")


class HeaderMismatch(ValueError):
    """What arrived does not describe what the receiver expects (FAILED_PRECONDITION)."""


def request_nonce(request_id: str) -> int:
    """The 64-bit nonce both sides derive from a request id; never 0 (0 means "not known")."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"hybridserve-kv").digest()
    return int.from_bytes(digest, "little") or 1


@dataclass(frozen=True)
class SlotHeader:
    dtype: str  # a WIRE_DTYPES name
    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_tokens: int
    model_id: str
    nonce: int = 0  # request_nonce(request id); 0: not tied to a request
    generation: int = 0  # stamped by the transport when it hands the slot out; 0 in an expected header
    version: int = VERSION
    layout: int = LAYOUT_LAYER_KV_HEAD_TOKEN_DIM

    def pack(self) -> bytes:
        raw = HEADER.pack(MAGIC, self.version, self.layout, WIRE_DTYPES[self.dtype].code, self.n_layers,
                          self.n_kv_heads, self.head_dim, self.n_tokens, self.model_id.encode()[:32],
                          self.nonce, self.generation)
        return raw.ljust(HEADER_SIZE, b"\0")

    @classmethod
    def unpack(cls, raw: bytes) -> "SlotHeader":
        (magic, version, layout, code, n_layers, n_kv, head_dim, n_tokens, model, nonce,
         generation) = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise HeaderMismatch(f"slot header magic {magic!r} is not {MAGIC!r}: not a KV slot (or a freed one)")
        names = {d.code: d.name for d in WIRE_DTYPES.values()}
        return cls(names.get(code, f"unknown({code})"), n_layers, n_kv, head_dim, n_tokens,
                   model.rstrip(b"\0").decode(errors="replace"), nonce=nonce, generation=generation,
                   version=version, layout=layout)

    def check_against(self, expected: "SlotHeader") -> None:
        """Raise HeaderMismatch naming every field that differs from `expected` (the nonce only where
        `expected` knows it; the generation is the transport's, never expected)."""
        order = ("version", "layout", "dtype", "n_layers", "n_kv_heads", "head_dim", "n_tokens", "model_id")
        diffs = [f"{f}={getattr(self, f)!r} (expected {getattr(expected, f)!r})"
                 for f in order if getattr(self, f) != getattr(expected, f)]
        if expected.nonce and self.nonce != expected.nonce:
            diffs.append("nonce: the slot belongs to another request")
        if diffs:
            raise HeaderMismatch("KV slot header mismatch: " + ", ".join(diffs))
