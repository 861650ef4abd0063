"""decode_fpga's KV port for the TCP hand-off: one listening socket per service, routing each
incoming connection to the request that waits for it, and the receiver that waits there.

prefill_gpu connects once per hand-off, to the address decode_fpga put in the Prefill call
(`kv_address`), and opens the stream with the slot header (tcp.py), which carries the request's
nonce (header.request_nonce). The inbox reads that header and hands the connection to the request
expecting that nonce; a connection no request expects, or one that does not open with a header,
is closed with an ERROR frame saying why. With the engine token (HYBRIDSERVE_ENGINE_TOKEN), a
header must come with its tag (tcp_frames.auth_tag) or the connection is refused before it is routed.
Nothing is read past the header before a request owns the connection.

Who calls what (decode side only; prefill_gpu's side is a plain `TcpSender`):

    inbox = KVInbox(host, port)             # the service, at start; inbox.close() on the way out
    with inbox.expecting(nonce) as waiting:  # the prefill peer, around its Prefill call
        InboxReceiver(inbox, ...).consume(the call's events)
            # on the call's SlotGrant (prefill_gpu connected before it sent the grant):
            # inbox.take(nonce) → the connection, imported to its DONE frame, answered OK
        # leaving: a connection not taken is closed; the request's end (`waiting.abort`) also
        # shuts a taken one, so a cancelled request never waits on the socket

The Prefill call keeps its role: its SlotGrant says prefill_gpu admitted the request (decode
reserves blocks then, hybrid.py), its PrefillDone carries the first token and the timings.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
from typing import Callable, Iterator

from services.errors import HandoffFailed, InvalidRequest
from services.kv.address import format_address
from services.kv.handoff import HandoffState, PrefillDone, SlotGrant
from services.kv.header import HeaderMismatch, SlotHeader
from services.kv.tcp import TcpReceiver
from services.kv.tcp_frames import DEFAULT_TIMEOUT_S, PeerGone, TcpListener, read_header_frame, send_refusal

log = logging.getLogger(__name__)

ACCEPT_TICK_S = 0.25  # how often the accept loop looks whether the inbox was closed
ARRIVAL_WAIT_S = DEFAULT_TIMEOUT_S  # from the call's SlotGrant (sent after connecting) to the connection


class Expected:
    """One request's place in the inbox: the connection once it arrived, and whether it was aborted."""

    def __init__(self, nonce: int):
        self.nonce = nonce
        self.arrived = threading.Event()
        self.conn: socket.socket | None = None
        self.header: SlotHeader | None = None
        self.taken = False
        self.aborted = False
        self.refused: str | None = None  # why its connection was refused (it cannot come any more)

    def abort(self) -> None:
        """The request ended (cancelled): unblock whoever reads its connection (idempotent)."""
        self.aborted = True
        self.arrived.set()
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.shutdown(socket.SHUT_RDWR)


class KVInbox:
    """The listening socket and the requests waiting for their connection. `advertised` is the
    "host:port" prefill_gpu is told to connect to (default: the bound address)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 header_timeout_s: float = DEFAULT_TIMEOUT_S, token: str | None = None):
        self.header_timeout_s, self._token = header_timeout_s, token
        self._listener = TcpListener(host, port, timeout_s=ACCEPT_TICK_S)
        self.address = self._listener.address
        self.advertised = advertise or format_address(*self.address)
        self._expected: dict[int, Expected] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-inbox", daemon=True)
        self._acceptor.start()

    @contextlib.contextmanager
    def expecting(self, nonce: int) -> Iterator[Expected]:
        """Register a request's nonce for the length of its hand-off; InvalidRequest if another
        request with the same id is being handed over now (its connection could not be told apart)."""
        entry = Expected(nonce)
        with self._lock:
            if nonce in self._expected:
                raise InvalidRequest("another request with this request id is being handed over now")
            self._expected[nonce] = entry
        try:
            yield entry
        finally:
            with self._lock:
                del self._expected[nonce]
            if entry.conn is not None and not entry.taken:
                send_refusal(entry.conn, "the request ended before its KV was read")
                entry.conn.close()

    def take(self, nonce: int, keep_going: Callable[[], bool] = lambda: True,
             wait_s: float = ARRIVAL_WAIT_S) -> tuple[socket.socket, SlotHeader] | None:
        """The request's connection and its header once it arrived (within `wait_s`, else PeerGone;
        HeaderMismatch if it came and was refused); None if `keep_going()` turned false or the
        request was aborted first."""
        with self._lock:
            entry = self._expected.get(nonce)
        if entry is None:
            raise HandoffFailed("a KV connection was asked for outside the request's hand-off")
        deadline = time.monotonic() + wait_s
        while not entry.arrived.wait(0.05):
            if not keep_going():
                return None
            if time.monotonic() > deadline:
                raise PeerGone(f"prefill_gpu's KV connection did not arrive within {wait_s:g} s")
        if entry.refused is not None:
            raise HeaderMismatch(entry.refused)
        if entry.aborted or not keep_going():
            return None
        entry.taken = True
        return entry.conn, entry.header

    def close(self) -> None:
        """Stop accepting; close the connections no request took (the taken ones are theirs)."""
        self._closed.set()
        self._acceptor.join()
        self._listener.close()
        with self._lock:
            left = [e.conn for e in self._expected.values() if e.conn is not None and not e.taken]
        for conn in left:
            conn.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except PeerGone:
                continue  # the tick: nobody connected
            except OSError as exc:
                log.warning("KV inbox: accept failed: %s", exc)
                time.sleep(ACCEPT_TICK_S)  # e.g. out of file descriptors: do not spin
                continue
            threading.Thread(target=self._route, args=(conn,), name="kv-inbox-route", daemon=True).start()

    def _route(self, conn: socket.socket) -> None:
        """Read the connection's header (bounded), give it to the request with that nonce or refuse it."""
        conn.settimeout(self.header_timeout_s)
        try:
            peer = format_address(*conn.getpeername()[:2])
            header, proven = read_header_frame(conn, self._token)
        except (HeaderMismatch, PeerGone, OSError) as exc:
            log.warning("KV inbox: refused a connection: %s", exc)
            send_refusal(conn, str(exc) if isinstance(exc, HeaderMismatch) else "no slot header")
            conn.close()
            return
        reason = None if proven else "the KV connection did not prove the engine token"
        with self._lock:
            entry = self._expected.get(header.nonce)
            if entry is not None and entry.conn is None and not entry.aborted:
                if reason is None:
                    entry.conn, entry.header = conn, header
                else:
                    entry.refused = reason  # its request fails now, not after the wait
                entry.arrived.set()
                if reason is None:
                    return
        reason = reason or "no request here waits for this KV (it ended, or it was never sent here)"
        log.warning("KV inbox: refused KV from %s: %s", peer, reason)
        send_refusal(conn, reason)
        conn.close()


class InboxReceiver(TcpReceiver):
    """hybrid mode's receiver on the TCP transport: `consume` takes the Prefill call's events; on its
    SlotGrant (whose nonce the peer filled in from the request) it takes the request's connection
    from the inbox and imports the KV from it, then returns the call's PrefillDone.

    `io_timeout_s` bounds each read on the connection: the first KV frame comes only once the
    prompt's prefill is computed, so it is the hand-off's deadline, not a network round trip."""

    def __init__(self, inbox: KVInbox, engine, seq, expected: SlotHeader, io_timeout_s: float):
        super().__init__(None, engine, seq, expected)
        self.inbox, self.io_timeout_s = inbox, io_timeout_s

    def consume(self, events, keep_going: Callable[[], bool] = lambda: True) -> PrefillDone | None:
        for msg in events:
            if isinstance(msg, SlotGrant):
                if not self._receive(msg, keep_going):
                    break
            elif isinstance(msg, PrefillDone):
                if self.state is not HandoffState.DONE:
                    raise HeaderMismatch("prefill_gpu said PrefillDone before the KV arrived")
                return msg
            # LayerReady: its bytes came on the connection already (or will); nothing to do here
            if not keep_going():
                break
        self.fail()
        return None

    def _receive(self, grant: SlotGrant, keep_going: Callable[[], bool]) -> bool:
        """The whole KV from the request's connection, imported and answered; False if the request
        was cancelled first. Raises PeerGone / HeaderMismatch / the engine's error."""
        with self._failing():
            if self.conn is not None or not grant.nonce:
                raise HeaderMismatch("a second slot grant, or one for no known request")
            taken = self.inbox.take(grant.nonce, keep_going)
            if taken is None:
                return False
            self.conn, self._routed_header = taken
            self.expected = dataclasses.replace(self.expected, nonce=grant.nonce)
            self.conn.settimeout(self.io_timeout_s)
            try:
                self.run(keep_going)
            except PeerGone:
                if not keep_going():
                    return False  # the request's end shut the connection
                raise
            return True
