"""The network hand-off transport: one request's KV over a plain TCP stream, for prefill and decode on two hosts.

Why a plain TCP stream and not gRPC: the KV is one large one-way flow of bytes between
two fixed peers. A stream of length-prefixed frames lets the receiver `recv_into` the
bytes straight into a numpy buffer (no protobuf copy, no 4 MiB message cap to chunk
around), and the control messages that matter here (the header, the slices, the end)
ride in the same ordered stream as the data they describe.

The stream's frames, their format and the listening socket are in tcp_frames.py.

Token slices need one more engine call than the layer path: `import_kv_slice(seq, layer,
start, kv)`, kv [2, n_kv_heads, n, head_dim] into positions [start, start + n) of one layer. A
whole layer (start 0, every token) goes through `import_kv_layer` as on the other transports.
"""
from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Callable, Iterator

import numpy as np

from services.kv.handoff import (HandoffEvent, HandoffState, KVReceiver, LayerReady, NetworkSender, PrefillDone,
                                SlotGrant, layout_of)
from services.kv.header import HeaderMismatch, SlotHeader
from services.kv.tcp_frames import (DEFAULT_TIMEOUT_S, DONE, DONE_PAYLOAD, ERROR, FRAME, HEADER, KV, MAX_ERROR_BYTES, OK,
                                    OK_PAYLOAD, PeerGone, SliceReady, auth_tag, read_header_payload, recv_exact,
                                    recv_frame, send_parts, send_refusal)
from services.kv.layout import WIRE_DTYPES

class TcpSender(NetworkSender):
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

    def send_slice(self, layer0: int, layer1: int, start: int, stop: int) -> None:
        """Queue layers [layer0, layer1) × positions [start, stop) of `layer_buffer` for the wire."""
        self._check_slice(layer0, layer1, start, stop)
        lay = self.layout
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
            kind, *_, nbytes = recv_frame(self._sock, "the receiver's answer")
            if kind == OK and nbytes == OK_PAYLOAD.size:
                raw = bytearray(nbytes)
                recv_exact(self._sock, memoryview(raw), "the receiver's answer")
                return OK_PAYLOAD.unpack(raw)[0]
            if kind == ERROR and nbytes <= MAX_ERROR_BYTES:
                raw = bytearray(nbytes)
                recv_exact(self._sock, memoryview(raw), "the receiver's reason")
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
                send_parts(self._sock, parts, "the KV")
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
            send_parts(self.conn, [FRAME.pack(OK, 0, 0, 0, 0, OK_PAYLOAD.size), OK_PAYLOAD.pack(self.on_device_at)],
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
            kind, l0, l1, t0, t1, nbytes = recv_frame(self.conn, "a frame header")
            if kind == HEADER:
                if self._header is not None:
                    raise HeaderMismatch("a second slot header frame")
                self._header, _, _ = read_header_payload(self.conn, nbytes)  # a tag is checked where it is routed
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
                recv_exact(self.conn, memoryview(self._payload), f"layers [{l0}, {l1}) × tokens [{t0}, {t1})")
                self.last_byte_at = time.time()
                yield SliceReady(l0, l1, t0, t1, nbytes, self.last_byte_at)
            elif kind == DONE:
                if nbytes != DONE_PAYLOAD.size:
                    raise HeaderMismatch(f"a DONE frame of {nbytes} bytes")
                raw = bytearray(nbytes)
                recv_exact(self.conn, memoryview(raw), "the end of the hand-off")
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
