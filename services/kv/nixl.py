"""The `nixl` hand-off transport: decode READs the KV out of prefill's registered host memory with NIXL
(Past 300 lines on purpose: the sender, the inbox and the receiver speak one control protocol over one
frame format, and its checks - nonce, token, header re-read - must be read together.)
(UCX underneath: RDMA between hosts that have it, the kernel's cross-memory copy on one host, TCP
otherwise), the way Dynamo, vLLM's NixlConnector, SGLang and llm-d move KV.

The bytes go through NIXL; everything else goes through a small control connection that prefill_gpu
opens to decode_fpga's KV inbox (tcp_inbox.py, the TCP transport's, unchanged), in tcp_frames.py's framing:

    sender → receiver
    HEADER  the slot header (nonce, generation), with its HMAC tag under the engine token (tcp_frames.auth_tag):
            the inbox routes the connection by its nonce and refuses it unless the tag proves the token
    OFFER   where the KV lies: the registered buffer's address and size, and the agent's metadata for
            that buffer only (connection info and its keys)
    READY   layers [l0, l1) × tokens [t0, t1) are written in the buffer (a whole layer, or a token slice)
    DONE    the PrefillDone (tcp_frames.DONE_PAYLOAD)
    receiver → sender
    ACCEPTED  the offer is taken: connected to the agent, the header READ and checked
    LANDED  layers × tokens of a READY are in the import buffer (after the READ completed)
    OK / ERROR   as on the TCP transport: every byte imported (and when), or why not

The buffer the sender registers is [64-byte slot header][KV in wire layout]. The receiver READs the
header out of it when it accepts the slot and again once every layer is on its device: it must equal
the header the connection announced (nonce and generation included). The sender zeroes it before it
lets the buffer go, so a READ that raced the buffer's end cannot pass as this request's KV.
The sender's agent progresses (nixl_agent.py's loop) only while the receiver may be READing: from each
OFFER, READY or DONE it sends until its answer (ACCEPTED, LANDED, OK) comes. Between slices, while the
prefill computes, nothing of the transport runs on prefill's cores.
Both sides use bounded waits: a READ not done in `read_timeout_s`, a peer that closes the control
connection or goes silent past its timeout, is PeerGone (a HandoffFailed) on whichever side notices.
Nothing of a hand-off outlives `close()`: its transfer handles, the peer's metadata (and with the last
hand-off from it, its connection: nixl_agent.py), the control connection. Its registered buffer (either
side's) goes back to the agent, kept for the next hand-off when this one ended cleanly (at most 256 MiB
idle: nixl_agent.Buffers), else deregistered.
"""
from __future__ import annotations

import dataclasses
import itertools
import select
import socket
import struct
import threading
import time

import numpy as np

from services.kv.handoff import HandoffState, NetworkSender, PrefillDone, SlotGrant
from services.kv.header import HEADER_SIZE, HeaderMismatch, SlotHeader
from services.kv.nixl_agent import NixlAgent, TransferFailed
from services.kv.tcp_frames import (DEFAULT_TIMEOUT_S, DONE, DONE_PAYLOAD, ERROR, FRAME, HEADER, MAX_ERROR_BYTES, OK,
                                    OK_PAYLOAD, PeerGone, SliceReady, auth_tag, recv_exact, recv_frame, send_parts)
from services.kv.tcp_inbox import InboxReceiver, KVInbox

OFFER, READY, LANDED, ACCEPTED = 16, 17, 18, 19
OFFER_HEAD = struct.Struct("<QQ")  # the buffer's address, its size; the agent metadata follows
MAX_OFFER_BYTES = 1 << 20
SCHEME = "nixl://"  # decode's kv_address for this transport: nixl://host:port (the control inbox)
_generations = itertools.count(1)  # this process's hand-offs: a header's generation, never 0


class NixlSender(NetworkSender):
    """prefill_gpu's side: its KV in host memory registered with the agent, offered to the receiver.

    Used like the TCP sender: write layer l's positions [a, b) into `layer_buffer(l)[:, :, a:b]`, then
    `send_slice(l, l + 1, a, b)` (or `layer_written(l)`); `finish(done)` waits for the receiver's OK.
    `landed` maps (l0, l1, t0, t1) to the unix time the receiver said those bytes landed.
    """

    def __init__(self, address: tuple[str, int], header: SlotHeader, agent: NixlAgent,
                 timeout_s: float = DEFAULT_TIMEOUT_S, token: str | None = None):
        super().__init__(dataclasses.replace(header, generation=next(_generations)))
        self.address, self.agent, self.timeout_s, self._token = address, agent, timeout_s, token
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._buf: np.ndarray | None = None
        self._lease = None  # the agent's kept buffer `_buf` lies in (registered)
        self._reader: threading.Thread | None = None
        self._answered = threading.Event()
        self._answer: float | BaseException | None = None
        self._due_since: float | None = None  # monotonic time since which an answer is due
        self._unanswered = 0  # OFFER, READY and DONE frames sent, not answered yet; > 0: the agent progresses
        self.landed: dict[tuple[int, int, int, int], float] = {}
        self.accepted_at: float | None = None  # unix time the receiver said it took the offer
        self.imported_at: float | None = None

    def _open(self) -> SlotGrant:
        try:
            self._sock = socket.create_connection(self.address, timeout=self.timeout_s)
        except OSError as exc:
            raise PeerGone(f"cannot reach the receiver at {self.address[0]}:{self.address[1]}: "
                           f"{exc.strerror or exc}") from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw = self.header.pack()
        self._buf, self._lease = self.agent.buffers.take(HEADER_SIZE + self.layout.nbytes)
        self._buf[:HEADER_SIZE] = np.frombuffer(raw, np.uint8)
        meta = self.agent.metadata(self._lease[1])
        tag = auth_tag(self._token, raw) if self._token else b""
        offer = OFFER_HEAD.pack(self._buf.ctypes.data, self._buf.nbytes) + meta
        self._reader = threading.Thread(target=self._read_answers, name="kv-nixl-sender", daemon=True)
        self._reader.start()  # first: a refusal of the header (sent before the offer is read) is heard
        self._frame([FRAME.pack(HEADER, 0, 0, 0, 0, len(raw) + len(tag)), raw + tag,
                     FRAME.pack(OFFER, 0, 0, 0, 0, len(offer)), offer], "the slot header and offer")
        return SlotGrant(0, self.layout.nbytes, self.header.n_tokens, self.header.dtype)

    def _data(self) -> np.ndarray:
        return self._buf[HEADER_SIZE:]

    def send_slice(self, layer0: int, layer1: int, start: int, stop: int) -> None:
        """Tell the receiver layers [layer0, layer1) × positions [start, stop) are in the buffer."""
        self._check_slice(layer0, layer1, start, stop)
        self._frame([FRAME.pack(READY, layer0, layer1, start, stop, 0)], "a READY frame")

    def finish(self, done: PrefillDone | None = None) -> float:
        """Send DONE; wait (bounded) for the receiver's verdict: the unix time it imported the last byte.
        PeerGone if it went away or stayed silent, HeaderMismatch if it refused the KV."""
        if self.state is not HandoffState.TRANSFERRING:
            raise RuntimeError(f"finish() on a {self.state.value} sender")
        done = done or PrefillDone(first_token=-1, prefill_s=0.0, queue_s=0.0, compute_done_at=time.time())
        payload = DONE_PAYLOAD.pack(done.first_token, done.prefill_s, done.queue_s, done.compute_done_at)
        self._frame([FRAME.pack(DONE, 0, 0, 0, 0, len(payload)), payload], "the end of the hand-off")
        if not self._answered.wait(self.timeout_s + 1.0):  # the reader gives up after timeout_s of silence
            raise PeerGone(f"the receiver did not answer within {self.timeout_s:g} s")
        if isinstance(self._answer, BaseException):
            raise self._answer
        self.imported_at = self._answer
        self.state = HandoffState.DONE
        return self.imported_at

    def _frame(self, parts: list, what: str) -> None:
        """Send control frames ending in one the receiver answers (OFFER, READY or DONE); what the
        receiver said (a refusal, its going away) wins over a send error."""
        if isinstance(self._answer, BaseException):
            raise self._answer
        try:
            with self._send_lock:
                if not self._unanswered:  # before the frame: the READ it starts finds this agent progressing
                    self._due_since = time.monotonic()  # an answer (ACCEPTED, LANDED, OK) is due from now on
                    self.agent.want_progress()
                self._unanswered += 1
                send_parts(self._sock, parts, what)
        except PeerGone:
            if self._answered.wait(1.0) and isinstance(self._answer, BaseException):
                raise self._answer from None
            raise

    def _answered_one(self) -> None:
        with self._send_lock:
            if not self._unanswered:
                return
            self._unanswered -= 1
            self._due_since = time.monotonic() if self._unanswered else None
            if not self._unanswered:  # no READ of ours can be in flight: the agent rests
                self.agent.drop_progress()

    def _read_answers(self) -> None:
        """ACCEPTED and LANDED frames until OK or ERROR; a closed connection, or silence for `timeout_s` while an
        answer is due, is PeerGone. (Silence while prefill computes is not: nothing is due then.)"""
        try:
            while True:
                due = self._due_since
                if due is not None and time.monotonic() - due > self.timeout_s:
                    raise PeerGone(f"the receiver went silent for {self.timeout_s:g} s mid-transfer")
                try:
                    readable, _, _ = select.select([self._sock], [], [], 0.25)
                except (OSError, ValueError) as exc:  # closed under us
                    raise PeerGone(f"the control connection was closed: {exc}") from None
                if not readable:
                    continue
                kind, l0, l1, t0, t1, nbytes = recv_frame(self._sock, "the receiver's answer")
                if kind in (LANDED, ACCEPTED) and nbytes == 0:
                    if kind == LANDED:
                        self.landed[(l0, l1, t0, t1)] = time.time()
                    else:
                        self.accepted_at = time.time()
                    self._answered_one()
                    continue
                raw = bytearray(min(nbytes, MAX_ERROR_BYTES))
                if kind == OK and nbytes == OK_PAYLOAD.size:
                    recv_exact(self._sock, memoryview(raw), "the receiver's answer")
                    self._answer = OK_PAYLOAD.unpack(raw)[0]
                elif kind == ERROR and nbytes <= MAX_ERROR_BYTES:
                    recv_exact(self._sock, memoryview(raw), "the receiver's reason")
                    self._answer = HeaderMismatch(f"the receiver refused the KV: {raw.decode(errors='replace')}")
                else:
                    self._answer = PeerGone(f"the receiver answered a frame of kind {kind} ({nbytes} bytes)")
                self._answered_one()  # DONE's
                return
        except PeerGone as exc:
            self._answer = exc
        finally:
            self._answered.set()

    def _close(self) -> None:
        if self._buf is not None:
            self._buf[:HEADER_SIZE] = 0  # first: a READ racing this end no longer finds this request's header
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # ends the answer reader
            except OSError:
                pass
            if self._reader is not None:
                self._reader.join(timeout=self.timeout_s)
                self._reader = None
            self._sock.close()
            self._sock = None
        with self._send_lock:
            if self._unanswered:  # ended with an answer due (a refusal, a peer gone): the agent rests
                self._unanswered = 0
                self.agent.drop_progress()
        if self._lease is not None:  # after the receiver's OK its READs are over: the next hand-off may reuse it
            self.agent.buffers.give(self._lease, reuse=self.state is HandoffState.DONE)
            self._lease = None
        self._buf = None


class NixlInbox(KVInbox):
    """decode_fpga's side of the service: the TCP inbox for the control connections, the agent that
    READs, the import buffers its receivers READ into, and the address prefill_gpu is told (`nixl://host:port`)."""

    def __init__(self, agent: NixlAgent, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 token: str | None = None, read_timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__(host, port, advertise, token=token)
        self.agent, self.read_timeout_s = agent, read_timeout_s
        self.buffers = agent.buffers  # the import buffers its receivers READ into
        self.advertised = SCHEME + self.advertised


class NixlReceiver(InboxReceiver):
    """hybrid mode's receiver on the `nixl` transport: takes the request's control connection from the
    inbox (on the Prefill call's SlotGrant, as the TCP one does), READs each announced slice into its
    import buffer, tells the sender it landed, and imports it into the engine."""

    def __init__(self, inbox: NixlInbox, engine, seq, expected: SlotHeader, io_timeout_s: float):
        super().__init__(inbox, engine, seq, expected, io_timeout_s)
        self.agent = inbox.agent
        self._remote: str | None = None
        self._remote_base = 0
        self._buf: np.ndarray | None = None  # [header][KV]: the READs' destination, the import's source
        self._lease = None  # the inbox's import buffer `_buf` lies in

    def events(self):
        """The control connection's frames as hand-off messages (the header was read where it was routed)."""
        header = self._routed_header
        if header is None:
            raise HeaderMismatch("a NIXL hand-off without a routed slot header")
        header.check_against(self.expected)  # before anything is registered or connected for it
        self._header = header
        self._take_offer()
        yield self._grant_of(header)
        lay = self.layout
        while True:
            kind, l0, l1, t0, t1, nbytes = recv_frame(self.conn, "a frame header")
            if kind == READY and nbytes == 0:
                if not (0 <= l0 < l1 <= lay.n_layers and 0 <= t0 < t1 <= lay.n_tokens):
                    raise HeaderMismatch(f"a READY frame for layers [{l0}, {l1}) × tokens [{t0}, {t1}) is outside "
                                         f"{lay.n_layers} layers × {lay.n_tokens} tokens")
                per_token = 2 * lay.n_kv_heads * lay.head_dim * lay.dtype.itemsize
                yield SliceReady(l0, l1, t0, t1, (l1 - l0) * (t1 - t0) * per_token, time.time())
            elif kind == DONE and nbytes == DONE_PAYLOAD.size:
                raw = bytearray(nbytes)
                recv_exact(self.conn, memoryview(raw), "the end of the hand-off")
                yield PrefillDone(*DONE_PAYLOAD.unpack(raw))
                return
            else:
                raise HeaderMismatch(f"a frame of kind {kind} ({nbytes} bytes) where READY or DONE was due")

    def _take_offer(self) -> None:
        kind, *_, nbytes = recv_frame(self.conn, "the NIXL offer")
        if kind != OFFER or not OFFER_HEAD.size < nbytes <= MAX_OFFER_BYTES:
            raise HeaderMismatch(f"a frame of kind {kind} ({nbytes} bytes) where the NIXL offer was due")
        raw = bytearray(nbytes)
        recv_exact(self.conn, memoryview(raw), "the NIXL offer")
        base, size = OFFER_HEAD.unpack_from(raw)
        if size != HEADER_SIZE + self.layout.nbytes:
            raise HeaderMismatch(f"the offered buffer holds {size} bytes; this request's KV takes "
                                 f"{HEADER_SIZE + self.layout.nbytes}")
        self._buf, self._lease = self.inbox.buffers.take(size)
        self._remote = self.agent.add_remote(bytes(raw[OFFER_HEAD.size:]))
        self._remote_base = base

    def accept(self, grant: SlotGrant) -> None:
        """Check the header READ out of the sender's memory, then tell the sender (its agent may rest)."""
        super().accept(grant)
        send_parts(self.conn, [FRAME.pack(ACCEPTED, 0, 0, 0, 0, 0)], "ACCEPTED")

    def _read(self, pairs: list[tuple[int, int]]) -> None:
        """READ each (offset, nbytes) of the buffer from the sender into the same offset here."""
        local, remote = self._buf.ctypes.data, self._remote_base
        try:
            self.agent.read(self._remote, [(local + o, remote + o, n) for o, n in pairs],
                            min(self.inbox.read_timeout_s, self.io_timeout_s))
        except TransferFailed as exc:
            raise PeerGone(str(exc)) from None

    def _read_header(self, grant: SlotGrant) -> SlotHeader:
        """The header as it is in the sender's memory now: it must be the one the connection announced."""
        self._read([(0, HEADER_SIZE)])
        header = SlotHeader.unpack(bytes(self._buf[:HEADER_SIZE]))
        if header != self._header:
            raise HeaderMismatch("the KV memory's header is not the one its connection announced "
                                 f"(nonce, generation or shape differ)")
        return header

    def import_slice(self, msg: SliceReady) -> None:
        """READ the slice into the import buffer, tell the sender it landed, import it into the engine."""
        with self._failing():
            lay, kv_at = self.layout, HEADER_SIZE
            if msg.start == 0 and msg.stop == lay.n_tokens:  # whole layers: one contiguous run
                first = kv_at + lay.layer_offset(msg.layer0)
                pairs = [(first, lay.layer_offset(msg.layer1 - 1) + lay.layer_nbytes - lay.layer_offset(msg.layer0))]
            else:  # one run per layer × (k, v) × kv head: positions [start, stop) of its [n_tokens, dim]
                row = lay.head_dim * lay.dtype.itemsize
                pairs = [(kv_at + lay.layer_offset(layer) + (kv * lay.n_kv_heads + h) * lay.n_tokens * row
                          + msg.start * row, (msg.stop - msg.start) * row)
                         for layer in range(msg.layer0, msg.layer1) for kv in (0, 1) for h in range(lay.n_kv_heads)]
            self._read(pairs)
            send_parts(self.conn, [FRAME.pack(LANDED, msg.layer0, msg.layer1, msg.start, msg.stop, 0)], "LANDED")
            kv = self._buf[kv_at:]
            if msg.start == 0 and msg.stop == lay.n_tokens:
                self._payload = kv[lay.layer_offset(msg.layer0): lay.layer_offset(msg.layer1 - 1) + lay.layer_nbytes]
            else:
                self._payload = np.concatenate([np.ascontiguousarray(
                    lay.layer_view(kv, layer)[:, :, msg.start:msg.stop]).view(np.uint8).ravel()
                    for layer in range(msg.layer0, msg.layer1)])
        super().import_slice(msg)

    def close(self) -> None:
        super().close()
        if self._remote is not None:
            self.agent.release_remote(self._remote)
            self._remote = None
        if self._lease is not None:
            # the engine's enqueued uploads read it up to finish_import, which a clean end has passed: the
            # next hand-off may READ into it; a failed one's may still be read (or landing): dropped
            self.inbox.buffers.give(self._lease, reuse=self.state is HandoffState.DONE)
            self._lease = None
