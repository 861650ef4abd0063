"""The network hand-off transport: one request's KV over a plain TCP stream, for prefill and decode on two hosts.

(Past 300 lines on purpose: the frame format, the sender and the receiver are one protocol;
kept in one module so each side's checks are read next to what the other side writes.)

Why a plain TCP stream and not gRPC: the KV is one large one-way flow of bytes between
two fixed peers. A stream of length-prefixed frames lets the receiver `recv_into` the
bytes straight into a numpy buffer (no protobuf copy, no 4 MiB message cap to chunk
around), and the control messages that matter here (the header, the slices, the end)
ride in the same ordered stream as the data they describe.

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

Token slices need one more engine call than the layer path: `import_kv_slice(seq, layer,
start, kv)`, kv [2, n_kv_heads, n, head_dim] into positions [start, start + n) of one layer. A
whole layer (start 0, every token) goes through `import_kv_layer` as on the other transports.
"""
from __future__ import annotations

import hashlib
import hmac
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from services.errors import HandoffFailed
from services.kv.handoff import (HandoffEvent, HandoffState, KVReceiver, KVSender, LayerReady, PrefillDone, SlotGrant,
                                layout_of)
from services.kv.header import HEADER_SIZE, HeaderMismatch, SlotHeader
from services.kv.layout import WIRE_DTYPES

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


def _recv_exact(sock: socket.socket, buf: memoryview, what: str) -> None:
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


def _recv_frame(sock: socket.socket, what: str) -> tuple[int, int, int, int, int, int]:
    raw = bytearray(FRAME.size)
    _recv_exact(sock, memoryview(raw), what)
    return FRAME.unpack(raw)


def _send(sock: socket.socket, parts: list, what: str) -> None:
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


def _read_header_payload(sock: socket.socket, nbytes: int) -> tuple[SlotHeader, bytes, bytes]:
    """The HEADER frame's payload: the header, its bytes and its tag (b"" when the sender sent none)."""
    if nbytes not in (HEADER_SIZE, HEADER_SIZE + TAG_SIZE):
        raise HeaderMismatch(f"a slot header frame of {nbytes} bytes (expected {HEADER_SIZE}, or "
                             f"{HEADER_SIZE + TAG_SIZE} with its tag)")
    raw = bytearray(nbytes)
    _recv_exact(sock, memoryview(raw), "the slot header")
    packed = bytes(raw[:HEADER_SIZE])
    return SlotHeader.unpack(packed), packed, bytes(raw[HEADER_SIZE:])


def read_header_frame(sock: socket.socket, token: str | None = None) -> tuple[SlotHeader, bool]:
    """The HEADER frame a connection opens with (HeaderMismatch if it opens with anything else), and
    whether its tag proves the engine `token` (always True without one)."""
    kind, *_, nbytes = _recv_frame(sock, "the slot header frame")
    if kind != HEADER:
        raise HeaderMismatch(f"the connection opened with a frame of kind {kind}, not the slot header")
    header, packed, tag = _read_header_payload(sock, nbytes)
    return header, token is None or hmac.compare_digest(tag, auth_tag(token, packed))


def send_refusal(sock: socket.socket, reason: str) -> None:
    """Tell the sender why its KV is not wanted (an ERROR frame), if it still listens."""
    raw = reason.encode()[:MAX_ERROR_BYTES]
    try:
        _send(sock, [FRAME.pack(ERROR, 0, 0, 0, 0, len(raw)), raw], "the refusal")
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


class TcpSender(KVSender):
    """The prefilling host's side: connects, streams the header then KV frames from a writer thread.

    The caller writes layer l's positions [a, b) into `layer_buffer(l)[:, :, a:b]`, then
    `send_slice(l, l + 1, a, b)` (or `layer_written(l)` for the whole layer, or `send_slice(0,
    n_layers, 0, n_tokens)` for everything at once). `finish(done)` sends the DONE frame and waits
    for the receiver's verdict: the unix time it imported the last byte.
    """

    def __init__(self, address: tuple[str, int], header: SlotHeader, timeout_s: float = DEFAULT_TIMEOUT_S,
                 token: str | None = None):
        super().__init__(header)
        self.address, self.timeout_s, self._token = address, timeout_s, token
        self._sock: socket.socket | None = None
        self._buf: np.ndarray | None = None
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self.imported_at: float | None = None  # the receiver's OK
        self.bytes_sent = 0

    def _open(self) -> SlotGrant:
        try:
            self._sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except OSError as exc:
            raise PeerGone(f"cannot reach the receiver at {self.address[0]}:{self.address[1]}: "
                           f"{exc.strerror or exc}") from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = np.zeros(self.layout.nbytes, np.uint8)
        self._writer = threading.Thread(target=self._write_loop, name="kv-tcp-sender", daemon=True)
        self._writer.start()
        raw = self.header.pack()
        tag = auth_tag(self._token, raw) if self._token else b""
        self._enqueue([FRAME.pack(HEADER, 0, 0, 0, 0, len(raw) + len(tag)), raw + tag])
        return SlotGrant(0, self.layout.nbytes, self.header.n_tokens, self.header.dtype)

    def _data(self) -> np.ndarray:
        return self._buf

    def _layer_location(self, layer: int) -> int:
        return self.layout.layer_offset(layer)

    def layer_written(self, layer: int, written_at: float | None = None) -> LayerReady:
        """Layer `layer` is complete: queue it for the wire (returns at once)."""
        self.send_slice(layer, layer + 1, 0, self.layout.n_tokens)
        return super().layer_written(layer, written_at)

    def send_slice(self, layer0: int, layer1: int, start: int, stop: int) -> None:
        """Queue layers [layer0, layer1) × positions [start, stop) of `layer_buffer` for the wire."""
        if self.state is not HandoffState.TRANSFERRING:
            raise RuntimeError(f"send_slice() on a {self.state.value} sender")
        lay = self.layout
        if not (0 <= layer0 < layer1 <= lay.n_layers and 0 <= start < stop <= lay.n_tokens):
            raise ValueError(f"slice layers [{layer0}, {layer1}) × tokens [{start}, {stop}) is outside "
                             f"{lay.n_layers} layers × {lay.n_tokens} tokens")
        if start == 0 and stop == lay.n_tokens:  # whole layers are contiguous on the wire: no copy
            parts = [self._buf[lay.layer_offset(layer0): lay.layer_offset(layer1 - 1) + lay.layer_nbytes]]
        else:  # [2, kv_heads, stop - start, dim] per layer, copied out of the strided view
            parts = [np.ascontiguousarray(lay.layer_view(self._buf, layer)[:, :, start:stop]).view(np.uint8).ravel()
                     for layer in range(layer0, layer1)]
        nbytes = sum(p.nbytes for p in parts)
        self._enqueue([FRAME.pack(KV, layer0, layer1, start, stop, nbytes), *parts])

    def finish(self, done: PrefillDone | None = None) -> float:
        """Send DONE, wait until the writer drained and the receiver answered: the unix time it imported
        the last byte. PeerGone if it went away, HeaderMismatch if it refused the KV."""
        if self.state is not HandoffState.TRANSFERRING:
            raise RuntimeError(f"finish() on a {self.state.value} sender")
        done = done or PrefillDone(first_token=-1, prefill_s=0.0, queue_s=0.0, compute_done_at=time.time())
        payload = DONE_PAYLOAD.pack(done.first_token, done.prefill_s, done.queue_s, done.compute_done_at)
        self._enqueue([FRAME.pack(DONE, 0, 0, 0, 0, len(payload)), payload])
        self._queue.put(None)
        self._writer.join()
        self._writer = None
        if self._error is not None:
            self._answer_or(self._error)  # the receiver may have said why it stopped reading
        self.imported_at = self._answer_or(None)
        self.state = HandoffState.DONE
        return self.imported_at

    def _answer_or(self, error: BaseException | None) -> float:
        """Read the receiver's OK / ERROR frame; re-raise `error` when there is none to read."""
        try:
            kind, *_, nbytes = _recv_frame(self._sock, "the receiver's answer")
            if kind == OK and nbytes == OK_PAYLOAD.size:
                raw = bytearray(nbytes)
                _recv_exact(self._sock, memoryview(raw), "the receiver's answer")
                return OK_PAYLOAD.unpack(raw)[0]
            if kind == ERROR and nbytes <= MAX_ERROR_BYTES:
                raw = bytearray(nbytes)
                _recv_exact(self._sock, memoryview(raw), "the receiver's reason")
                raise HeaderMismatch(f"the receiver refused the KV: {raw.decode(errors='replace')}")
            raise PeerGone(f"the receiver answered a frame of kind {kind} ({nbytes} bytes)")
        except PeerGone:
            if error is not None:
                raise error
            raise

    def _enqueue(self, parts: list) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(parts)

    def _write_loop(self) -> None:
        while True:
            parts = self._queue.get()
            if parts is None:
                return
            if self._error is not None:
                continue  # drain: the caller learns of the error on its next call
            try:
                _send(self._sock, parts, "the KV")
                self.bytes_sent += sum(memoryview(p).nbytes for p in parts)
            except PeerGone as exc:
                self._error = exc

    def _close(self) -> None:
        if self._writer is not None:
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)  # unblocks a writer stuck in sendall
                except OSError:
                    pass
            self._queue.put(None)
            self._writer.join(timeout=self.timeout_s)
            self._writer = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf = None


class TcpReceiver(KVReceiver):
    """The decoding host's side of one accepted connection: checks the header, imports every slice.

    `engine` implements import_kv_layer / finish_import and, for token slices, import_kv_slice
    (see the module docstring). `run()` drives the whole hand-off and answers the sender.
    `header`: the connection's slot header when whoever accepted it read it already (to route it).
    """

    def __init__(self, conn: socket.socket | None, engine, seq, expected: SlotHeader,
                 header: SlotHeader | None = None):
        super().__init__(engine, seq, expected)
        self.conn = conn
        self._routed_header = header
        self._header: SlotHeader | None = None
        self._filled: dict[int, int] = {}  # layer -> token positions imported so far
        self._payload: np.ndarray | None = None
        self.last_byte_at: float | None = None

    def run(self, keep_going: Callable[[], bool] = lambda: True) -> PrefillDone:
        """Receive and import the whole hand-off; answer OK (or ERROR with the reason) and close.
        Raises what failed: HeaderMismatch, PeerGone (also when `keep_going()` turned false between
        frames), or the engine's error."""
        try:
            done = self._import_frames(self.events(), keep_going)
            if done is None:
                raise PeerGone("the stream ended before the hand-off was done")
            _send(self.conn, [FRAME.pack(OK, 0, 0, 0, 0, OK_PAYLOAD.size), OK_PAYLOAD.pack(self.on_device_at)],
                  "the answer")
            return done
        except PeerGone:
            raise
        except Exception as exc:  # the sender learns why; only a HeaderMismatch's text says more than its type
            send_refusal(self.conn, str(exc) if isinstance(exc, HeaderMismatch)
                         else f"the import failed ({type(exc).__name__})")
            raise
        finally:
            self.fail()
            self.close()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def events(self) -> Iterator[HandoffEvent | SliceReady]:
        """The stream's frames as hand-off messages; a KV frame's bytes wait in `_payload` for its import."""
        lay = self.layout
        if self._routed_header is not None:  # its frame was read off the stream already
            self._header = self._routed_header
            yield self._grant_of(self._header)
        while True:
            kind, l0, l1, t0, t1, nbytes = _recv_frame(self.conn, "a frame header")
            if kind == HEADER:
                if self._header is not None:
                    raise HeaderMismatch("a second slot header frame")
                self._header, _, _ = _read_header_payload(self.conn, nbytes)  # a tag is checked where it is routed
                yield self._grant_of(self._header)
            elif kind == KV:
                if self.state is not HandoffState.TRANSFERRING:
                    raise HeaderMismatch("KV arrived before the slot header")
                if not (0 <= l0 < l1 <= lay.n_layers and 0 <= t0 < t1 <= lay.n_tokens):
                    raise HeaderMismatch(f"a KV frame for layers [{l0}, {l1}) × tokens [{t0}, {t1}) is outside "
                                         f"{lay.n_layers} layers × {lay.n_tokens} tokens")
                want = (l1 - l0) * 2 * lay.n_kv_heads * (t1 - t0) * lay.head_dim * lay.dtype.itemsize
                if nbytes != want:
                    raise HeaderMismatch(f"a KV frame of {nbytes} bytes where its ranges make {want}")
                self._payload = np.empty(nbytes, np.uint8)
                _recv_exact(self.conn, memoryview(self._payload), f"layers [{l0}, {l1}) × tokens [{t0}, {t1})")
                self.last_byte_at = time.time()
                yield SliceReady(l0, l1, t0, t1, nbytes, self.last_byte_at)
            elif kind == DONE:
                if nbytes != DONE_PAYLOAD.size:
                    raise HeaderMismatch(f"a DONE frame of {nbytes} bytes")
                raw = bytearray(nbytes)
                _recv_exact(self.conn, memoryview(raw), "the end of the hand-off")
                yield PrefillDone(*DONE_PAYLOAD.unpack(raw))
                return
            else:
                raise HeaderMismatch(f"a frame of unknown kind {kind}")

    @staticmethod
    def _grant_of(header: SlotHeader) -> SlotGrant:
        return SlotGrant(0, layout_of(header).nbytes if header.dtype in WIRE_DTYPES else 0, header.n_tokens,
                         header.dtype)

    def consume(self, events, keep_going=lambda: True) -> PrefillDone | None:
        return self._import_frames(events, keep_going)

    def _import_frames(self, events, keep_going) -> PrefillDone | None:
        # not `consume` itself: a subclass may take its events from elsewhere and still run() the socket
        def layered():  # SliceReady is this transport's own message: import it here, pass the rest on
            for msg in events:
                if isinstance(msg, SliceReady):
                    self.import_slice(msg)
                    if not keep_going():
                        return
                else:
                    yield msg
        return super().consume(layered(), keep_going)

    def import_slice(self, msg: SliceReady) -> None:
        """Import the frame's layers × positions; a layer counts as imported once every position has come
        (the stream carries each position once, in order)."""
        with self._failing():
            lay, n = self.layout, msg.stop - msg.start
            per_layer = 2 * lay.n_kv_heads * n * lay.head_dim * lay.dtype.itemsize
            for i, layer in enumerate(range(msg.layer0, msg.layer1)):
                if self._filled.get(layer, 0) != msg.start:
                    raise HeaderMismatch(f"layer {layer} tokens [{msg.start}, {msg.stop}) arrived after "
                                         f"{self._filled.get(layer, 0)} tokens: out of order or twice")
                kv = self._payload[i * per_layer: (i + 1) * per_layer].view(lay.dtype).reshape(
                    2, lay.n_kv_heads, n, lay.head_dim)
                if msg.start == 0 and msg.stop == lay.n_tokens:
                    self.engine.import_kv_layer(self.seq, layer, kv)
                else:
                    self.engine.import_kv_slice(self.seq, layer, msg.start, kv)
                self._filled[layer] = msg.stop
                if msg.stop == lay.n_tokens:
                    self.layers.add(layer)
                self.bytes += per_layer
            if self.first_written_at is None:
                self.first_written_at = msg.arrived_at
            self._payload = None

    def _read_header(self, grant: SlotGrant) -> SlotHeader:
        if self._header is None:
            raise HeaderMismatch("no slot header has arrived")
        return self._header  # one stream, one request: it cannot change under the reader

    def _layer_bytes(self, msg: LayerReady):
        raise HeaderMismatch("this transport carries KV frames, not LayerReady messages")
