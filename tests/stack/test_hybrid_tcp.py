"""Hybrid mode with the KV over TCP: prefill_gpu and decode_fpga as real processes that share no
/dev/shm (prefill_gpu in a mount namespace with a /dev/shm of its own where the machine allows it;
decode_fpga never maps prefill_gpu's arena either way, which the test checks in its memory map).

prefill_gpu reaches decode_fpga's KV port through a relay in this process (decode advertises the
relay's address), so a test can cut one connection in the middle of its KV: a network failure
without a hook in the services.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from harness.process import ROOT
from services.decode_fpga.settings import DecodeSettings
from services.lifetime import launch_env
from services.prefill_gpu.settings import PrefillSettings
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc
from tests.conftest import random_prompt
from tests.services_harness import Service, free_port
from tests.stack.conftest import DECODE_ENV, PREFILL_ENV
from tests.stack.test_hybrid import VOCAB, cancel_hybrid_during_prefill, generate

KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers × (k, v) × kv heads × head dim × fp32
CAN_UNSHARE = os.geteuid() == 0 and shutil.which("unshare") is not None


class OwnShmService(Service):
    """A service in a mount namespace of its own with a fresh /dev/shm (root only): no other process
    can map what it puts there."""

    def start(self) -> "OwnShmService":
        self.env = self.launch_env()
        self._log = open(self.log_path, "w")
        script = 'mount -t tmpfs -o size=128m hybridserve-own-shm /dev/shm && exec "$0" -m "$1"'
        self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                                      sys.executable, self.module], cwd=ROOT,
                                     env={**os.environ, **self.env, **launch_env()},
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        return self


class Relay:
    """A TCP relay on loopback to `target`; `cut_next(n)` closes the next connection once n bytes went
    through it toward the target (both directions are closed, as a failed link would)."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._server.getsockname()[1]
        self._cut_next: int | None = None
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_next(self, nbytes: int) -> None:
        self._cut_next = nbytes

    def close(self) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                src, _ = self._server.accept()
            except OSError:
                return
            dst = socket.create_connection(self.target)
            cut, self._cut_next = self._cut_next, None
            threading.Thread(target=self._pump, args=(src, dst, cut), daemon=True).start()
            threading.Thread(target=self._pump, args=(dst, src, None), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, cut: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(1 << 16):
                if cut is not None and sent + len(data) >= cut:
                    dst.sendall(data[: cut - sent])
                    self.cuts += 1
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


@pytest.fixture(scope="module")
def tcp_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tcp-engines")
    kv_port = free_port()
    relay = Relay(("127.0.0.1", kv_port))
    cache = {PrefillSettings.env_name("profile_cache"): str(tmp / "profile")}
    prefill = (OwnShmService if CAN_UNSHARE else Service)("services.prefill_gpu", {**cache, **PREFILL_ENV},
                                                         tmp / "prefill.log").start()
    decode = Service("services.decode_fpga", {
        **cache, **DECODE_ENV, DecodeSettings.env_name("prefill_address"): prefill.address,
        DecodeSettings.env_name("kv_transport"): "tcp",
        DecodeSettings.env_name("kv_listen"): f"127.0.0.1:{kv_port}",
        DecodeSettings.env_name("kv_advertise"): relay.address}, tmp / "decode.log").start()
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        with grpc.insecure_channel(prefill.address) as a, grpc.insecure_channel(decode.address) as b:
            yield prefill, decode, pb_grpc.EngineStub(a), pb_grpc.EngineStub(b), relay
    finally:
        decode.stop()
        prefill.stop()
        relay.close()


def maps_of(service: Service) -> str:
    return Path(f"/proc/{service.proc.pid}/maps").read_text()


def holds_nothing(stub, within: float = 5.0) -> bool:
    """No request running or waiting on the engine and none of its KV blocks held by one (it frees a
    failed request between two steps of its loop, so this waits a little)."""
    deadline = time.monotonic() + within
    while True:
        info = stub.Info(pb.InfoRequest(), timeout=5)
        idle = info.num_requests_running == 0 and info.num_requests_waiting == 0 and info.kv_cache_usage_ratio == 0
        if idle or time.monotonic() > deadline:
            return idle
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("n", [5, 200])
def test_greedy_hybrid_over_tcp_equals_gpu_and_fpga(tcp_pair, n):
    prefill, decode, pre, dec, _ = tcp_pair
    prompt = random_prompt(n, VOCAB, seed=61 + n)
    gpu, _ = generate(pre, prompt, pb.MODE_GPU, 12)
    hybrid, last = generate(dec, prompt, pb.MODE_HYBRID, 12)
    fpga, _ = generate(dec, prompt, pb.MODE_FPGA, 12)
    assert gpu == fpga == hybrid
    t = last.timings
    assert t.handoff_bytes == n * KV_BYTES_PER_TOKEN and 0 <= t.handoff_exposed_s <= t.handoff_total_s
    # the KV cannot have come through the arena: decode_fpga never mapped it, and (as root) could not see it
    arena = pre.Info(pb.InfoRequest()).arena_name
    assert arena and arena not in maps_of(decode) and "hybridserve-kv-" not in maps_of(decode)
    if CAN_UNSHARE:
        assert not (Path("/dev/shm") / arena).exists()
        assert arena in maps_of(prefill)  # it is there, in prefill_gpu's own /dev/shm
    assert holds_nothing(dec)


@pytest.mark.slow
def test_a_prefix_decode_has_cached_is_not_sent_again(tcp_pair):
    _, _, pre, dec, _ = tcp_pair
    shared = random_prompt(64, VOCAB, seed=66)
    first, second = shared + random_prompt(7, VOCAB, seed=67), shared + [21, 22, 23]
    _, first_last = generate(dec, first, pb.MODE_HYBRID, 4)
    hybrid, last = generate(dec, second, pb.MODE_HYBRID, 12)
    assert first_last.timings.handoff_bytes == len(first) * KV_BYTES_PER_TOKEN
    assert last.timings.handoff_bytes == (len(second) - 64) * KV_BYTES_PER_TOKEN  # the suffix only
    assert hybrid == generate(pre, second, pb.MODE_GPU, 12)[0]
    assert holds_nothing(dec)


@pytest.mark.slow
def test_a_connection_cut_mid_handoff_fails_the_request_and_frees_decodes_blocks(tcp_pair):
    prefill, _, pre, dec, relay = tcp_pair
    prompt = random_prompt(200, VOCAB, seed=68)
    cuts = relay.cuts
    relay.cut_next(1 << 20)  # about three of the 30 layers, then the link is gone
    with pytest.raises(grpc.RpcError) as err:
        generate(dec, prompt, pb.MODE_HYBRID, 4)
    assert relay.cuts == cuts + 1
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details().startswith("internal error in decode_fpga (request ")  # nothing more leaks out
    assert holds_nothing(dec)
    assert holds_nothing(pre)  # prefill_gpu dropped its side too
    assert prefill.metric("hybridserve_kv_arena_slots_in_use") == 0  # over TCP no slot is ever taken
    # the next request over a sound link is served as usual
    tokens, last = generate(dec, prompt, pb.MODE_HYBRID, 4)
    assert len(tokens) == 4 and last.timings.handoff_bytes == 200 * KV_BYTES_PER_TOKEN


@pytest.mark.slow
def test_a_hybrid_request_cancelled_during_its_handoff_frees_both_engines(tcp_pair):
    """Cancelled while prefill_gpu computes (decode_fpga waits on the KV connection): the request ends
    at once, decode_fpga's blocks and prefill_gpu's work are both given back."""
    _, _, pre, dec, _ = tcp_pair
    cancel_hybrid_during_prefill(dec, seed=69)
    assert holds_nothing(dec) and holds_nothing(pre)
    tokens, _ = generate(dec, random_prompt(9, VOCAB, seed=70), pb.MODE_HYBRID, 2)
    assert len(tokens) == 2


@pytest.mark.slow
def test_a_kv_address_prefill_cannot_use_fails_the_call_cleanly(tcp_pair):
    _, _, pre, _, _ = tcp_pair
    with pytest.raises(grpc.RpcError) as nobody:  # nothing listens there
        list(pre.Prefill(pb.PrefillRequest(request_id="rq-nobody", prompt_token_ids=[5, 6, 7],
                                           kv_address=f"127.0.0.1:{free_port()}"), timeout=30))
    assert nobody.value.code() == grpc.StatusCode.INTERNAL
    assert nobody.value.details() == "internal error in prefill_gpu (request rq-nobody); see its log"
    with pytest.raises(grpc.RpcError) as malformed:
        list(pre.Prefill(pb.PrefillRequest(prompt_token_ids=[5, 6, 7], kv_address="no-port"), timeout=30))
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_address" in malformed.value.details()
    assert holds_nothing(pre)
