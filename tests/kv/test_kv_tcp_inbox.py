"""decode_fpga's KV inbox with real sockets on loopback: each connection reaches the request whose
nonce its header carries; one that nobody waits for, or that sends no header, is refused with a
reason; the waits are bounded; closing leaves no listener and no thread behind."""
from __future__ import annotations

import socket
import threading

import pytest

from services.errors import InvalidRequest
from services.kv.address import parse_address
from services.kv.header import HeaderMismatch, SlotHeader, request_nonce
from services.kv.tcp import TcpSender
from services.kv.tcp_frames import ERROR, FRAME, PeerGone
from services.kv.tcp_inbox import KVInbox

TIMEOUT_S = 5.0


def header(request: str) -> SlotHeader:
    return SlotHeader("fp32", 2, 1, 4, 3, "tiny", nonce=request_nonce(request))


@pytest.fixture
def inbox():
    box = KVInbox(header_timeout_s=TIMEOUT_S)
    yield box
    box.close()


def test_each_connection_reaches_the_request_with_its_nonce(inbox):
    a, b = request_nonce("req-a"), request_nonce("req-b")
    with inbox.expecting(a), inbox.expecting(b):
        with TcpSender(parse_address(inbox.advertised), header("req-b"), TIMEOUT_S) as tx_b, \
                TcpSender(parse_address(inbox.advertised), header("req-a"), TIMEOUT_S) as tx_a:
            tx_b.open()
            tx_a.open()
            conn_a, got_a = inbox.take(a)
            conn_b, got_b = inbox.take(b)
            assert (got_a.nonce, got_b.nonce) == (a, b)
            # each connection is the one its sender opened
            assert conn_a.getpeername() == tx_a._sock.getsockname()
            assert conn_b.getpeername() == tx_b._sock.getsockname()
            conn_a.close()
            conn_b.close()


def test_a_connection_nobody_waits_for_is_refused_with_the_reason(inbox):
    with TcpSender(parse_address(inbox.advertised), header("nobody"), TIMEOUT_S) as tx:
        tx.open()
        with pytest.raises(HeaderMismatch, match="no request here waits"):
            tx.finish()


def test_a_connection_without_a_slot_header_is_refused(inbox):
    with socket.create_connection(parse_address(inbox.advertised), timeout=TIMEOUT_S) as raw:
        raw.sendall(FRAME.pack(2, 0, 1, 0, 3, 96))  # a KV frame first
        kind, *_, nbytes = FRAME.unpack(raw.recv(FRAME.size, socket.MSG_WAITALL))
        assert kind == ERROR and b"slot header" in raw.recv(nbytes, socket.MSG_WAITALL)


def test_a_connection_left_untaken_is_refused_when_its_request_ends(inbox):
    with TcpSender(parse_address(inbox.advertised), header("gone"), TIMEOUT_S) as tx:
        with inbox.expecting(request_nonce("gone")) as waiting:
            tx.open()
            assert waiting.arrived.wait(TIMEOUT_S)
        with pytest.raises(HeaderMismatch, match="ended before its KV was read"):
            tx.finish()


def test_the_wait_for_a_connection_is_bounded(inbox):
    with inbox.expecting(request_nonce("late")):
        with pytest.raises(PeerGone, match="did not arrive within 0.3 s"):
            inbox.take(request_nonce("late"), wait_s=0.3)


def test_a_request_that_ends_stops_waiting(inbox):
    nonce = request_nonce("cancelled")
    with inbox.expecting(nonce) as waiting:
        threading.Timer(0.2, waiting.abort).start()
        assert inbox.take(nonce, wait_s=60) is None
    stop = threading.Event()
    with inbox.expecting(nonce):
        threading.Timer(0.2, stop.set).start()
        assert inbox.take(nonce, keep_going=lambda: not stop.is_set(), wait_s=60) is None


def test_two_hand_offs_of_one_request_id_at_once_are_refused(inbox):
    with inbox.expecting(request_nonce("twice")):
        with pytest.raises(InvalidRequest, match="request id"):
            with inbox.expecting(request_nonce("twice")):
                pass
    with inbox.expecting(request_nonce("twice")):  # free again once the first ended
        pass


def test_closing_stops_listening_and_leaves_no_thread():
    before = {t.ident for t in threading.enumerate()}
    box = KVInbox()
    address = parse_address(box.advertised)
    box.close()
    with TcpSender(address, header("after"), TIMEOUT_S) as tx:
        with pytest.raises(PeerGone, match="cannot reach"):
            tx.open()
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("kv-inbox")]


def test_with_the_engine_token_only_a_header_that_proves_it_is_routed():
    box = KVInbox(header_timeout_s=TIMEOUT_S, token="s3cret")
    try:
        address, nonce = parse_address(box.advertised), request_nonce("authed")
        for token, refused in ((None, True), ("wrong", True), ("s3cret", False)):
            with box.expecting(nonce), TcpSender(address, header("authed"), TIMEOUT_S, token=token) as tx:
                tx.open()
                if refused:
                    with pytest.raises(HeaderMismatch, match="did not prove the engine token"):
                        tx.finish()
                    # the request waiting for it learns at once why nothing will come
                    with pytest.raises(HeaderMismatch, match="did not prove the engine token"):
                        box.take(nonce, wait_s=60)
                else:
                    conn, got = box.take(nonce)
                    assert got == header("authed")
                    conn.close()
    finally:
        box.close()


def test_without_a_token_of_its_own_the_inbox_routes_a_tagged_header(inbox):
    nonce = request_nonce("tagged")
    with inbox.expecting(nonce), TcpSender(parse_address(inbox.advertised), header("tagged"), TIMEOUT_S,
                                           token="s3cret") as tx:
        tx.open()
        conn, got = inbox.take(nonce)
        assert got == header("tagged")
        conn.close()
