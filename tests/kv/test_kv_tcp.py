"""The TCP hand-off on loopback with real sockets and the real torch engine on both ends (its KV blocks
receiving, tests/kv/block_sink.py): greedy tokens
after a TCP hand-off (whole, by layer, by token slice) equal the in-process hand-off's; a header that
does not match is refused on both ends; a peer that goes away mid-transfer fails the other end cleanly."""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from services.kv.handoff import HandoffState, PrefillDone
from services.kv.header import HeaderMismatch, SlotHeader, request_nonce
from services.kv.inprocess import InProcessLink, InProcessReceiver, InProcessSender
from services.kv.tcp import TcpReceiver, TcpSender
from services.kv.tcp_frames import FRAME, HEADER, KV, PeerGone, TcpListener
from tests.engine.local_handoff import prefilled_kv
from tests.kv.block_sink import BlockSink

PROMPT_LEN, N_NEW, TIMEOUT_S = 37, 6, 5.0


@pytest.fixture(scope="module")
def prefilled(torch_engine, model_config):
    """One real prefill: the prompt, its KV in wire layout [layers, 2, kv_heads, n, dim] and first token."""
    prompt = np.random.default_rng(5).integers(3, model_config.vocab_size, PROMPT_LEN).tolist()
    first, kv = prefilled_kv(torch_engine, prompt)
    return prompt, kv, first


def header_for(cfg, n_tokens=PROMPT_LEN, dtype="fp32", request="req-1"):
    return SlotHeader(dtype, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_tokens, cfg.model_id,
                      nonce=request_nonce(request))


def send(sender, kv, mode, first):
    """Everything in `kv` through `sender` as `mode` says: 'whole', 'layers' or a slice length."""
    sender.open()
    n_layers, n = kv.shape[0], kv.shape[3]
    if mode == "whole":
        for layer in range(n_layers):
            sender.layer_buffer(layer)[...] = kv[layer]
        sender.send_slice(0, n_layers, 0, n)
    elif mode == "layers":
        for layer in range(n_layers):
            sender.layer_buffer(layer)[...] = kv[layer]
            sender.layer_written(layer)
    else:  # token slices: every layer of [a, b) as if the engine had just computed them
        for a in range(0, n, mode):
            b = min(a + mode, n)
            for layer in range(n_layers):
                sender.layer_buffer(layer)[:, :, a:b] = kv[layer][:, :, a:b]
            sender.send_slice(0, n_layers, a, b)
    return sender.finish(PrefillDone(first_token=first, prefill_s=0.5, queue_s=0.0, compute_done_at=1.0))


def receive_in_thread(listener, make_receiver):
    """Accept one connection and run a receiver on it in a thread: (thread, result dict)."""
    result = {}

    def run():
        try:
            rx = make_receiver(listener.accept())
            result["receiver"] = rx
            result["done"] = rx.run()
        except BaseException as exc:  # handed to the test thread
            result["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, result


@pytest.mark.parametrize("mode", ["whole", "layers", 16, 5])
def test_greedy_tokens_after_a_tcp_handoff_equal_the_in_process_ones(mode, torch_engine, model_config, prefilled):
    prompt, kv, first = prefilled
    # the in-process hand-off: the reference
    link = InProcessLink()
    ref = BlockSink(torch_engine, PROMPT_LEN + N_NEW)
    with InProcessSender(link, header_for(model_config)) as tx:
        msgs = [tx.open()]
        for layer in range(model_config.n_layers):
            tx.layer_buffer(layer)[...] = kv[layer]
            msgs.append(tx.layer_written(layer))
        tx.finish()
        InProcessReceiver(link, ref, None, header_for(model_config)).consume(
            msgs + [PrefillDone(first, 0.5, 0.0, 1.0)])
    want = ref.greedy_after(first, N_NEW)
    # the same KV over TCP on loopback, into other blocks
    sink = BlockSink(torch_engine, PROMPT_LEN + N_NEW, first_block=len(ref.block_table))
    with TcpListener(timeout_s=TIMEOUT_S) as listener:
        th, result = receive_in_thread(listener, lambda c: TcpReceiver(c, sink, None, header_for(model_config)))
        with TcpSender(listener.address, header_for(model_config), timeout_s=TIMEOUT_S) as tx:
            imported_at = send(tx, kv, mode, first)
        th.join(TIMEOUT_S)
    assert "error" not in result, result.get("error")
    rx = result["receiver"]
    assert rx.state is HandoffState.DONE and rx.on_device_at == imported_at
    assert rx.bytes == kv.nbytes and result["done"].first_token == first
    assert tx.state is HandoffState.DONE
    assert sink.greedy_after(result["done"].first_token, N_NEW) == want


@pytest.mark.parametrize("field, value, named", [("n_tokens", PROMPT_LEN + 1, f"{PROMPT_LEN + 1} tokens"),
                                                 ("dtype", "fp16", "of fp16"), ("model_id", "another-model", "model_id"),
                                                 ("n_layers", 3, "n_layers=3")])
def test_a_header_that_does_not_match_is_refused_on_both_ends(field, value, named, model_config, prefilled):
    _, kv, first = prefilled
    with TcpListener(timeout_s=TIMEOUT_S) as listener:
        th, result = receive_in_thread(listener, lambda c: TcpReceiver(c, None, None, header_for(model_config)))
        sent = dataclasses.replace(header_for(model_config), **{field: value})
        with TcpSender(listener.address, sent, timeout_s=TIMEOUT_S) as tx:
            tx.open()
            tx.send_slice(0, 1, 0, sent.n_tokens)
            with pytest.raises(HeaderMismatch, match="refused") as refused:
                tx.finish()
            assert named in str(refused.value)  # the sender is told why
        th.join(TIMEOUT_S)
    assert isinstance(result["error"], HeaderMismatch) and named in str(result["error"])
    assert result["receiver"].state is HandoffState.FAILED


def test_another_requests_kv_is_refused(model_config, prefilled):
    with TcpListener(timeout_s=TIMEOUT_S) as listener:
        th, result = receive_in_thread(listener, lambda c: TcpReceiver(c, None, None, header_for(model_config)))
        with TcpSender(listener.address, header_for(model_config, request="req-2"), timeout_s=TIMEOUT_S) as tx:
            tx.open()
            with pytest.raises(HeaderMismatch, match="nonce"):
                tx.finish()
        th.join(TIMEOUT_S)
    assert "nonce" in str(result["error"])


def test_a_sender_that_goes_away_mid_transfer_fails_the_receiver_cleanly(torch_engine, model_config, prefilled):
    _, kv, _ = prefilled
    sink = BlockSink(torch_engine, PROMPT_LEN + 1)
    with TcpListener(timeout_s=TIMEOUT_S) as listener:
        th, result = receive_in_thread(listener, lambda c: TcpReceiver(c, sink, None, header_for(model_config)))
        raw = socket.create_connection(listener.address, timeout=TIMEOUT_S)
        raw.sendall(FRAME.pack(HEADER, 0, 0, 0, 0, 64) + header_for(model_config).pack())
        layer0 = kv[0].tobytes()
        raw.sendall(FRAME.pack(KV, 0, 1, 0, PROMPT_LEN, len(layer0)) + layer0[: len(layer0) // 2])
        raw.close()  # half a layer, then gone
        th.join(TIMEOUT_S)
    assert not th.is_alive()
    assert isinstance(result["error"], PeerGone) and "closed" in str(result["error"])
    assert result["receiver"].state is HandoffState.FAILED and result["receiver"].conn.fileno() == -1


def test_a_receiver_that_goes_away_mid_transfer_fails_the_sender_cleanly(model_config, prefilled):
    _, kv, _ = prefilled
    threads_before = threading.active_count()
    with TcpListener(timeout_s=TIMEOUT_S) as listener:
        tx = TcpSender(listener.address, header_for(model_config), timeout_s=TIMEOUT_S)
        tx.open()
        conn = listener.accept()
        conn.recv(100)
        conn.close()  # the receiving host is gone after a hundred bytes
        with pytest.raises(PeerGone):
            for _ in range(50):  # the writer notices on a later send; the next call raises
                for layer in range(model_config.n_layers):
                    tx.layer_buffer(layer)[...] = kv[layer]
                tx.send_slice(0, model_config.n_layers, 0, PROMPT_LEN)
            tx.finish()
        tx.close()
    assert tx.state is HandoffState.FAILED
    assert tx._sock is None and tx._writer is None  # closed: nothing left behind
    assert threading.active_count() == threads_before


def test_no_receiver_listening_is_a_clear_error(model_config):
    with TcpListener(timeout_s=TIMEOUT_S) as listener:
        address = listener.address
    with TcpSender(address, header_for(model_config), timeout_s=TIMEOUT_S) as tx:
        with pytest.raises(PeerGone, match="cannot reach"):
            tx.open()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="network namespaces need root and iproute2 (ip); run as root to cover the cross-namespace path")
def test_a_handoff_across_two_network_namespaces(model_config, prefilled):
    """The bench's namespaces and veth pair, one small hand-off of random bytes between them, then gone."""
    from bench.cross_host_net import Netns

    with Netns(rate=None) as ns:
        out = subprocess.run([sys.executable, "-m", "bench.cross_host", "--selftest", ns.tx, ns.rx],
                             capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
        assert out.returncode == 0, out.stderr[-2000:]
        assert "selftest ok" in out.stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns.tx not in names and ns.rx not in names
