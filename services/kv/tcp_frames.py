"""The frames of the TCP hand-off (tcp.py) and of NIXL's control stream (nixl.py), and the listening socket.

The stream, sender → receiver (every frame: `FRAME` then `nbytes` of payload):

    HEADER  the versioned 64-byte slot header (header.py), first and once; when the sender holds
            the engine token, followed in the same frame by a 32-byte tag, HMAC-SHA256(token,
            header), which proves the token without sending it (`auth_tag`)
    KV      layers [l0, l1) × token positions [t0, t1): for each layer in order,
            its [2, n_kv_heads, t1 - t0, head_dim] block of the wire dtype
            (a whole layer: t0 = 0, t1 = n_tokens; the whole KV: l0 = 0, l1 = n_layers)
    DONE    the PrefillDone (first token and timings)

and back, receiver → sender, once: OK (every byte imported; the payload is the unix time it
was) or ERROR (a reason: a header that did not match, a frame out of place). The sender
writes from a background thread, so a slice travels while the engine computes the next one;
`finish` waits for the receiver's verdict (bounded), so the sender knows the KV was imported.

Both ends use bounded socket timeouts; a peer that goes away (closed, reset, silent past the
timeout) is `PeerGone`, a HandoffFailed, on whichever side notices. Nothing outlives `close()`:
the socket, the thread, the buffer.
"""
from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from dataclasses import dataclass

from services.errors import HandoffFailed
from services.kv.header import HEADER_SIZE, HeaderMismatch, SlotHeader

# kind, layer0, layer1, token0, token1, payload bytes
FRAME = struct.Struct("<BxHHIIQ")
HEADER, KV, DONE, OK, ERROR = 1, 2, 3, 4, 5
DONE_PAYLOAD = struct.Struct("<qddd")  # first_token, prefill_s, queue_s, compute_done_at
OK_PAYLOAD = struct.Struct("<d")  # unix time the last byte was imported
MAX_ERROR_BYTES = 4096
TAG_SIZE = 32  # the HEADER frame's optional HMAC-SHA256 tag
DEFAULT_TIMEOUT_S = 10.0


class PeerGone(HandoffFailed):
    """The other end closed, reset or went silent past the timeout in the middle of a hand-off."""


@dataclass(frozen=True)
class SliceReady:
    """Sender → receiver: layers [layer0, layer1) of token positions [start, stop) have arrived."""

    layer0: int
    layer1: int
    start: int
    stop: int
    nbytes: int
    arrived_at: float


def recv_exact(sock: socket.socket, buf: memoryview, what: str) -> None:
    """Fill `buf` from `sock`; PeerGone if the peer closes or times out before it is full."""
    got = 0
    while got < len(buf):
        try:
            n = sock.recv_into(buf[got:])
        except socket.timeout as exc:
            raise PeerGone(f"the peer went silent while sending {what} ({got} of {len(buf)} bytes)") from exc
        except OSError as exc:
            raise PeerGone(f"the connection failed while receiving {what}: {exc.strerror or exc}") from exc
        if n == 0:
            raise PeerGone(f"the peer closed the connection in the middle of {what} ({got} of {len(buf)} bytes)")
        got += n


def recv_frame(sock: socket.socket, what: str) -> tuple[int, int, int, int, int, int]:
    raw = bytearray(FRAME.size)
    recv_exact(sock, memoryview(raw), what)
    return FRAME.unpack(raw)


def send_parts(sock: socket.socket, parts: list, what: str) -> None:
    try:
        for part in parts:
            sock.sendall(part)
    except socket.timeout as exc:
        raise PeerGone(f"the peer stopped reading while {what} was sent") from exc
    except OSError as exc:
        raise PeerGone(f"the connection failed while sending {what}: {exc.strerror or exc}") from exc


def auth_tag(token: str, raw_header: bytes) -> bytes:
    """HMAC-SHA256 of one packed slot header under the engine token: it ties the proof to the request
    (the header carries its nonce), and the token itself never crosses the wire."""
    return hmac.new(token.encode(), b"hybridserve-kv-auth\0" + raw_header, hashlib.sha256).digest()


def read_header_payload(sock: socket.socket, nbytes: int) -> tuple[SlotHeader, bytes, bytes]:
    """The HEADER frame's payload: the header, its bytes and its tag (b"" when the sender sent none)."""
    if nbytes not in (HEADER_SIZE, HEADER_SIZE + TAG_SIZE):
        raise HeaderMismatch(f"a slot header frame of {nbytes} bytes (expected {HEADER_SIZE}, or "
                             f"{HEADER_SIZE + TAG_SIZE} with its tag)")
    raw = bytearray(nbytes)
    recv_exact(sock, memoryview(raw), "the slot header")
    packed = bytes(raw[:HEADER_SIZE])
    return SlotHeader.unpack(packed), packed, bytes(raw[HEADER_SIZE:])


def read_header_frame(sock: socket.socket, token: str | None = None) -> tuple[SlotHeader, bool]:
    """The HEADER frame a connection opens with (HeaderMismatch if it opens with anything else), and
    whether its tag proves the engine `token` (always True without one)."""
    kind, *_, nbytes = recv_frame(sock, "the slot header frame")
    if kind != HEADER:
        raise HeaderMismatch(f"the connection opened with a frame of kind {kind}, not the slot header")
    header, packed, tag = read_header_payload(sock, nbytes)
    return header, token is None or hmac.compare_digest(tag, auth_tag(token, packed))


def send_refusal(sock: socket.socket, reason: str) -> None:
    """Tell the sender why its KV is not wanted (an ERROR frame), if it still listens."""
    raw = reason.encode()[:MAX_ERROR_BYTES]
    try:
        send_parts(sock, [FRAME.pack(ERROR, 0, 0, 0, 0, len(raw)), raw], "the refusal")
    except PeerGone:
        pass


class TcpListener:
    """The receiving host's socket: one accepted connection per hand-off. `address` is (host, port)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S, backlog: int = 16):
        self.timeout_s = timeout_s
        self._sock = socket.create_server((host, port), backlog=backlog)
        self._sock.settimeout(timeout_s)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]

    def accept(self) -> socket.socket:
        """The next sender's connection (PeerGone if none comes within the timeout)."""
        try:
            conn, _ = self._sock.accept()
        except socket.timeout as exc:
            raise PeerGone(f"no sender connected within {self.timeout_s:g} s") from exc
        conn.settimeout(self.timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "TcpListener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
