"""The `nixl` hand-off with real NIXL agents on loopback (UCX pinned to `lo`) and the real torch engine:
greedy tokens after a NIXL hand-off (whole, by layer, by token slice) equal the in-process hand-off's;
the sender is told each slice landed; a wrong nonce, a wrong engine token, memory whose header is not
the announced one are refused on both ends; a sender killed mid-transfer (another process) and a
receiver gone mid-transfer fail the other end within a bounded time; nothing is left registered,
connected or waiting after a hand-off, whichever way it ended."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX would use eth0 as well; keep its tcp transport (see docs)

from services.kv import transports  # noqa: E402
from services.kv.address import parse_address  # noqa: E402
from services.kv.handoff import HandoffState, PrefillDone, SlotGrant  # noqa: E402
from services.kv.header import HEADER_SIZE, HeaderMismatch, request_nonce  # noqa: E402
from services.kv.tcp_frames import PeerGone  # noqa: E402
from tests.kv.block_sink import BlockSink  # noqa: E402
from tests.kv.test_kv_tcp import N_NEW, PROMPT_LEN, header_for, prefilled, send  # noqa: E402,F401

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None,
                                reason="the nixl extra is not installed (pip install 'hybridserve[nixl]')")

TIMEOUT_S = 5.0
TOKEN = "engine-secret"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def agents():
    from services.kv.nixl_agent import NixlAgent

    prefill, decode = NixlAgent("prefill-test"), NixlAgent("decode-test")
    yield prefill, decode
    prefill.close()
    decode.close()


@pytest.fixture(scope="module")
def inbox(agents):
    from services.kv.nixl import NixlInbox

    box = NixlInbox(agents[1], token=TOKEN, read_timeout_s=TIMEOUT_S)
    yield box
    box.close()


def control_address(inbox) -> tuple[str, int]:
    return parse_address(inbox.advertised.removeprefix("nixl://"))


def receive_in_thread(inbox, engine, seq, expected, request="req-1", go: threading.Event | None = None):
    """A NixlReceiver taking the request's connection from the inbox, in a thread: (thread, result).
    With `go`, it takes the connection only once `go` is set (the request waits for it from the start)."""
    from services.kv.nixl import NixlReceiver

    nonce, result, armed = request_nonce(request), {}, threading.Event()

    def run():
        try:
            with inbox.expecting(nonce):
                armed.set()
                rx = NixlReceiver(inbox, engine, seq, expected, TIMEOUT_S)
                result["receiver"] = rx
                if go is not None:
                    go.wait(TIMEOUT_S)
                grant = SlotGrant(0, 0, expected.n_tokens, expected.dtype, nonce=nonce)
                result["done"] = rx.consume([grant, PrefillDone(-1, 0.0, 0.0, 0.0)])
        except BaseException as exc:  # handed to the test thread
            result["error"] = exc
        result["ended_at"] = time.monotonic()
        armed.set()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    # the request waits for its KV before any sender connects, as in the engine (which reserves first): a
    # sender that came first was refused ("no request here waits for this KV") on a busy machine
    armed.wait(TIMEOUT_S)
    return th, result


def sender(inbox, agents, header, token=TOKEN):
    from services.kv.nixl import NixlSender

    return NixlSender(control_address(inbox), header, agents[0], timeout_s=TIMEOUT_S, token=token)


def nothing_left(inbox, agents, tx=None) -> None:
    """After a hand-off: no peer loaded, no memory served, no request waiting, the sender closed."""
    assert agents[1].remotes == {}
    assert agents[0]._serving == 0
    assert inbox._expected == {}
    if tx is not None:
        assert tx._lease is None and tx._sock is None and tx._buf is None and tx._reader is None


@pytest.mark.parametrize("mode", ["whole", "layers", 16])
def test_greedy_tokens_after_a_nixl_handoff_equal_the_in_process_ones(mode, agents, inbox, torch_engine,
                                                                       model_config, prefilled):
    prompt, kv, first = prefilled
    from services.engine.one_request import greedy_tokens

    want = greedy_tokens(torch_engine, prompt, N_NEW)  # the torch engine's own tokens after the prompt
    sink = BlockSink(torch_engine, PROMPT_LEN + N_NEW)
    th, result = receive_in_thread(inbox, sink, None, header_for(model_config))
    with sender(inbox, agents, header_for(model_config)) as tx:
        imported_at = send(tx, kv, mode, first)
        th.join(TIMEOUT_S)
        assert "error" not in result, result.get("error")
        rx = result["receiver"]
        assert rx.state is HandoffState.DONE and rx.on_device_at == imported_at and rx.bytes == kv.nbytes
        # the sender was told each slice landed, before the receiver's OK
        slices = {"whole": 1, "layers": model_config.n_layers, 16: -(-PROMPT_LEN // 16)}[mode]
        assert len(tx.landed) == slices and max(tx.landed.values()) <= time.time()
    assert tx.state is HandoffState.DONE
    assert sink.greedy_after(first, N_NEW) == want
    nothing_left(inbox, agents, tx)


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        assert time.monotonic() < deadline, f"not within {TIMEOUT_S} s: {what}"
        time.sleep(0.005)


def test_the_senders_agent_progresses_only_while_a_read_of_its_memory_is_due(agents, inbox, torch_engine,
                                                                            model_config, prefilled):
    """While prefill computes (between slices) the sender's progress loop sleeps: a loop waking every
    100 µs through a whole prefill slowed it by a third on this 2-core host. It runs from each frame the
    receiver answers after a READ (OFFER, READY, DONE) until that answer, and the KV still lands."""
    _, kv, first = prefilled
    prefill_agent = agents[0]
    th, result = receive_in_thread(inbox, BlockSink(torch_engine, PROMPT_LEN + 1), None, header_for(model_config))
    with sender(inbox, agents, header_for(model_config)) as tx:
        tx.open()
        assert prefill_agent._serving == 1  # the offer is out: the receiver connects and READs the header
        wait_for(lambda: tx.accepted_at is not None, "the receiver accepted the offer")
        for layer in range(model_config.n_layers):
            wait_for(lambda: prefill_agent._serving == 0, "the agent at rest once the last answer came")
            calls = prefill_agent.progress_calls
            time.sleep(0.02)  # "computing the layer": no progress call meanwhile
            assert prefill_agent.progress_calls == calls
            tx.layer_buffer(layer)[...] = kv[layer]
            tx.layer_written(layer)
            assert prefill_agent._serving == 1 or len(tx.landed) == layer + 1  # on until LANDED
            wait_for(lambda: len(tx.landed) == layer + 1, f"layer {layer} landed")
        tx.finish(PrefillDone(first_token=first, prefill_s=0.5, queue_s=0.0, compute_done_at=1.0))
        assert prefill_agent._serving == 0
    th.join(TIMEOUT_S)
    assert "error" not in result, result.get("error")
    assert result["receiver"].state is HandoffState.DONE and result["receiver"].bytes == kv.nbytes
    nothing_left(inbox, agents, tx)


def test_a_clean_handoffs_buffers_serve_the_next_one(agents, inbox, torch_engine, model_config, prefilled):
    """Each side's registered buffer goes back to its agent: the next hand-off of the same size is offered
    from, and READ into, the same memory (no fresh pages, no registration), and still carries its own KV."""
    _, kv, first = prefilled
    addresses, offered = [], []
    for _ in range(2):
        th, result = receive_in_thread(inbox, BlockSink(torch_engine, PROMPT_LEN + 1), None, header_for(model_config))
        with sender(inbox, agents, header_for(model_config)) as tx:
            send(tx, kv * (len(addresses) + 1), "layers", first)  # other bytes the second time
            offered.append(tx._buf.ctypes.data)
        th.join(TIMEOUT_S)
        assert "error" not in result, result.get("error")
        rx = result["receiver"]
        addresses.append(rx._buf.ctypes.data)
        assert np.array_equal(rx._buf[HEADER_SIZE:].view(np.float32).reshape(kv.shape), kv * len(addresses))
        assert any(buf.ctypes.data == addresses[-1] for buf, _ in inbox.buffers._idle)  # back, for the next
    assert addresses[0] == addresses[1] and offered[0] == offered[1]
    assert any(buf.ctypes.data == offered[0] for buf, _ in agents[0].buffers._idle)
    assert inbox.buffers.idle_bytes <= inbox.buffers.keep_bytes
    nothing_left(inbox, agents, tx)


def test_kv_for_another_request_is_refused_on_both_ends(agents, inbox, model_config):
    with inbox.expecting(request_nonce("req-1")) as waiting:
        with sender(inbox, agents, header_for(model_config, request="req-2")) as tx:  # the wrong nonce
            with pytest.raises(HeaderMismatch, match="no request here waits"):
                tx.open()
                tx.finish()
        assert not waiting.arrived.is_set()  # nothing of it reached the waiting request
    nothing_left(inbox, agents, tx)


@pytest.mark.parametrize("token", ["another-secret", None])
def test_kv_without_the_engine_token_is_refused_on_both_ends(token, agents, inbox, model_config):
    th, result = receive_in_thread(inbox, None, None, header_for(model_config))
    with sender(inbox, agents, header_for(model_config), token=token) as tx:
        with pytest.raises(HeaderMismatch, match="did not prove the engine token"):
            tx.open()  # refused as soon as its header is read (or else at the latest by finish)
            tx.finish()
    th.join(TIMEOUT_S)
    assert isinstance(result["error"], HeaderMismatch) and "engine token" in str(result["error"])
    nothing_left(inbox, agents, tx)


def test_memory_whose_header_is_not_the_announced_one_is_refused(agents, inbox, model_config):
    """The connection proves the token and names this request, but the memory offered holds another
    request's header: the receiver READs it, refuses, and says why."""
    go = threading.Event()
    th, result = receive_in_thread(inbox, None, None, header_for(model_config), go=go)
    with sender(inbox, agents, header_for(model_config)) as tx:
        other = header_for(model_config, request="req-other").pack()
        tx.open()
        tx._buf[:HEADER_SIZE] = list(other)
        go.set()  # only now does the receiver read the memory
        with pytest.raises(HeaderMismatch, match="not the one its connection announced"):
            tx.finish()
    th.join(TIMEOUT_S)
    assert isinstance(result["error"], HeaderMismatch) and result["receiver"].state is HandoffState.FAILED
    # a failed hand-off's buffer is not handed to the next one
    assert all(buf.ctypes.data != result["receiver"]._buf.ctypes.data for buf, _ in inbox.buffers._idle)
    nothing_left(inbox, agents, tx)


SENDER_SCRIPT = """
import sys, time, numpy as np
from services.kv.header import SlotHeader, request_nonce
from services.kv.nixl import NixlSender
from services.kv.nixl_agent import NixlAgent
host, port, layers, n_tokens, kv_heads, dim, model, token = sys.argv[1:]
header = SlotHeader("fp32", int(layers), int(kv_heads), int(dim), int(n_tokens), model, nonce=request_nonce("req-1"))
tx = NixlSender((host, int(port)), header, NixlAgent("prefill-doomed"), timeout_s=30, token=token)
tx.open()
for layer in range(3):
    tx.layer_buffer(layer)[...] = 1.0
    tx.layer_written(layer)
while len(tx.landed) < 3:
    time.sleep(0.01)
print("three layers landed", flush=True)
time.sleep(60)
"""


def test_a_sender_killed_mid_transfer_fails_the_receiver_within_bounded_time(agents, inbox, torch_engine,
                                                                             model_config):
    cfg = model_config
    th, result = receive_in_thread(inbox, BlockSink(torch_engine, PROMPT_LEN + 1), None, header_for(cfg))
    host, port = control_address(inbox)
    proc = subprocess.Popen([sys.executable, "-c", SENDER_SCRIPT, host, str(port), str(cfg.n_layers),
                             str(PROMPT_LEN), str(cfg.n_kv_heads), str(cfg.head_dim), cfg.model_id, TOKEN],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        lines = iter(proc.stdout.readline, "")
        assert any(line.strip() == "three layers landed" for line in lines), f"the sender ended: {proc.poll()}"
        assert result.get("receiver") is not None and result["receiver"].layers == {0, 1, 2}
        proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        th.join(TIMEOUT_S)
    finally:
        proc.kill()
        proc.wait()
    assert not th.is_alive()
    assert isinstance(result["error"], PeerGone) and result["ended_at"] - killed_at < 2.0
    assert result["receiver"].state is HandoffState.FAILED
    nothing_left(inbox, agents)


def test_a_receiver_gone_mid_transfer_fails_the_sender_within_bounded_time(agents, inbox, torch_engine,
                                                                           model_config, prefilled):
    """The receiving request ends after two layers (its engine's request was cancelled): the sender's next
    call raises PeerGone, and both ends let go of everything."""
    from services.kv.nixl import NixlReceiver

    _, kv, _ = prefilled
    nonce, result = request_nonce("req-1"), {}

    def run():
        with inbox.expecting(nonce):
            rx = NixlReceiver(inbox, BlockSink(torch_engine, PROMPT_LEN + 1), None, header_for(model_config), TIMEOUT_S)
            result["receiver"] = rx
            try:
                rx.consume([SlotGrant(0, 0, PROMPT_LEN, "fp32", nonce=nonce)], keep_going=lambda: len(rx.layers) < 2)
            except BaseException as exc:
                result["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    tx = sender(inbox, agents, header_for(model_config))
    tx.open()
    started = time.monotonic()
    with pytest.raises(PeerGone):
        for layer in range(model_config.n_layers):
            tx.layer_buffer(layer)[...] = kv[layer]
            tx.layer_written(layer)
            time.sleep(0.02)
        tx.finish()
    assert time.monotonic() - started < TIMEOUT_S
    tx.close()
    th.join(TIMEOUT_S)
    assert result["receiver"].state is HandoffState.FAILED
    nothing_left(inbox, agents, tx)


def test_the_registry_names_each_transport_and_a_missing_extra_at_start(monkeypatch):
    from services.decode_fpga.settings import DecodeSettings

    assert transports.NAMES == ("shm", "tcp", "nixl")
    assert transports.parse_kv_address("") is None
    assert transports.parse_kv_address("10.0.0.7:5000")[0].name == "tcp"
    assert transports.parse_kv_address("nixl://[::1]:5000") == (transports.get("nixl"), ("::1", 5000))
    with pytest.raises(ValueError, match="names no network KV transport"):
        transports.parse_kv_address("shm://10.0.0.7:5000")
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        DecodeSettings(kv_transport="rdma")
    # where the extra is not installed (find_spec finds neither module), choosing nixl fails the settings
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("nixl") else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'hybridserve\[nixl\]'"):
        DecodeSettings(kv_transport="nixl")
