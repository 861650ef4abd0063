"""The engine runtime as plain Python, and its thin gRPC layer.

Hybrid mode with both real engines in this process over the in-process transport
(no servicer context, no second process); the request states it passes through;
typed errors → statuses; and, over real gRPC on loopback, a prefill that fails
inside reaches decode's client as INTERNAL with a fixed message, never UNAVAILABLE.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.decode_fpga.hybrid import DecodeRuntime, PrefillPeers
from services.decode_fpga.server import GrpcPrefillPeer
from services.decode_fpga.settings import DecodeSettings
from services.engine.requests import Cancellation, EngineRequest, RequestTimings
from services.errors import (Cancelled, HandoffFailed, HandoffTimedOut, InvalidRequest, PeerUnavailable, PromptTooLong,
                             QueueFull)
from services.engine.sampling import SamplingParams
from services.engine.service import EngineServicer
from services.engine.status import status_of
from services.kv.arena import Arena, ArenaFull
from services.kv.header import HeaderMismatch
from services.kv.inprocess import InProcessLink, InProcessReceiver, InProcessSender
from services.prefill_gpu.runtime import PrefillRuntime
from services.prefill_gpu.server import PrefillServicer
from services.prefill_gpu.settings import PrefillSettings
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc
from tests.conftest import random_prompt
from tests.services_harness import free_port

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class InProcessPeer:
    """prefill_gpu's runtime as decode's PrefillPeer, the KV in plain memory. `sends` is the
    dtype it actually sends, to play a peer that disagrees with what it announced."""

    def __init__(self, prefill: PrefillRuntime):
        self.prefill_runtime, self.link = prefill, InProcessLink()
        self.sends = prefill.settings.wire_dtype
        self.reserved_when_called: int | None = None  # decode's requests waiting for remote KV then
        self.reserved_after_grant: int | None = None  # ... and once its SlotGrant was taken in
        self.watch = None  # a DecodeRuntime to look at when prefill is called
        self.skipped: list[int] = []  # skip_tokens of each prefill asked for
        self.before_grant = lambda: None  # runs after the peer admitted the request, before its SlotGrant
        self.refuse: Exception | None = None  # raised instead of prefilling (the peer's admission refused)
        self.fail_after: int | None = None  # the stream breaks after this many messages (the peer died)

    def wire_dtype(self) -> str:
        return self.prefill_runtime.settings.wire_dtype

    def receiver(self, engine, seq, expected):
        return InProcessReceiver(self.link, engine, seq, expected)

    def prefill(self, request, wire_dtype, cancel, skip_tokens=0):
        if self.watch is not None:
            self.reserved_when_called = self.watch.loop.scheduler.num_waiting_for_remote_kv
        self.skipped.append(skip_tokens)
        if self.refuse is not None:
            raise self.refuse
        events = self.prefill_runtime.prefill(request, self.sends, cancel,
                                              new_sender=lambda header: InProcessSender(self.link, header),
                                              skip_tokens=skip_tokens)
        return self._watched(events)

    def _watched(self, events):
        for i, msg in enumerate(events):
            if i == self.fail_after:
                raise HandoffFailed(f"the prefill stream broke after {i} messages")
            if i == 0:
                self.before_grant()
            elif i == 1 and self.watch is not None:  # the receiver took the grant in and asked for more
                self.reserved_after_grant = self.watch.loop.scheduler.num_waiting_for_remote_kv
            yield msg

    def close(self) -> None:
        pass


@contextlib.contextmanager
def hybrid_in_process(model, ocl_engine, decode_settings: DecodeSettings):
    """(prefill_gpu's runtime over a CPU torch engine of `model`, decode_fpga's over `ocl_engine`), the
    hand-off in process: every mode of one checkpoint without a process."""
    from services.prefill_gpu.engine import TorchEngine

    arena = Arena(8 << 20)
    prefill = PrefillRuntime(TorchEngine(model.config, model.weights, device="cpu"), model,
                             PrefillSettings(wire_dtype="fp32", profile_at_start=False), arena)
    decode = DecodeRuntime(ocl_engine, model, decode_settings, InProcessPeer(prefill))
    try:
        yield prefill, decode
    finally:
        decode.close()
        prefill.close()
        arena.close()


def assert_every_mode_gives(prefill, decode, hf_model, n_new: int, prompt_lengths=(1, 23)) -> None:
    """gpu, fpga and hybrid give transformers' greedy tokens for random prompts of these lengths."""
    from tests.conftest import hf_greedy

    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    for n_prompt in prompt_lengths:
        prompt = random_prompt(n_prompt, prefill.loaded.config.vocab_size, seed=5)
        want = hf_greedy(hf_model, prompt, n_new)
        for runtime, mode in ((prefill, "gpu"), (decode, "fpga"), (decode, "hybrid")):
            assert tokens_and_last(runtime, prompt, mode, params)[0] == want, (mode, n_prompt)


@pytest.fixture(scope="module")
def arena():
    a = Arena(64 << 20)
    yield a
    a.close()


@pytest.fixture(scope="module")
def prefill(torch_engine, loaded_model, arena):
    # the hand-off admission as served by default: sized from memory (handoff_admission.py)
    settings = PrefillSettings(max_concurrency=1, queue_depth=1, prefill_queue_depth=4, slot_hold_s=5.0,
                               wire_dtype="fp32")
    runtime = PrefillRuntime(torch_engine, loaded_model, settings, arena)
    yield runtime
    runtime.close()


@pytest.fixture
def peer(prefill):
    return InProcessPeer(prefill)


@pytest.fixture
def decode(ocl_engine, loaded_model, peer):
    runtime = DecodeRuntime(ocl_engine, loaded_model, DecodeSettings(max_concurrency=4, queue_depth=4), peer)
    yield runtime
    runtime.close()


def all_free(runtime, timeout: float = 5.0) -> bool:
    """Every request gone from the runtime's loop and every KV block back (the loop frees a cancelled
    request between two steps, so this waits for the next one)."""
    deadline = time.monotonic() + timeout
    while True:
        free = runtime.loop.num_unfinished == 0 and runtime.loop.scheduler.block_manager.usage == 0.0
        if free or time.monotonic() > deadline:
            return free
        time.sleep(0.01)


def tokens_and_last(runtime, prompt, mode, params=GREEDY, cancel=None):
    events = list(runtime.generate(EngineRequest(tuple(prompt), params, mode), cancel or Cancellation()))
    return [e.token for e in events], events[-1]


def test_hybrid_in_process_equals_gpu_and_fpga(prefill, decode, peer, ocl_engine, model_config):
    prompt = random_prompt(40, model_config.vocab_size, seed=31)
    gpu, _ = tokens_and_last(prefill, prompt, "gpu")
    hybrid, last = tokens_and_last(decode, prompt, "hybrid")  # first: nothing of it is cached yet
    fpga, _ = tokens_and_last(decode, prompt, "fpga")
    assert gpu == fpga == hybrid
    t = last.timings
    assert last.finish_reason == "length" and t.generated_tokens == 8 and t.prompt_tokens == 40
    assert t.handoff_bytes == 30 * 2 * 3 * 40 * 64 * 4 and 0 <= t.handoff_exposed_s <= t.handoff_total_s
    assert peer.link.slots_in_use == 0 and all_free(decode)


def test_hybrid_hands_over_only_what_decode_has_not_cached(prefill, decode, peer, model_config):
    """A second prompt sharing a 64-token prefix with the first: decode_fpga holds that prefix's blocks
    (imported for the first request), so prefill_gpu ships only the rest; the tokens stay those of
    the other modes."""
    shared = random_prompt(64, model_config.vocab_size, seed=36)
    first, second = shared + random_prompt(6, model_config.vocab_size, seed=37), shared + [11, 12, 13]
    tokens_and_last(decode, first, "hybrid")
    hybrid, last = tokens_and_last(decode, second, "hybrid")
    assert peer.skipped[-2:] == [0, 64]
    assert last.timings.handoff_bytes == 30 * 2 * 3 * (len(second) - 64) * 64 * 4
    assert last.timings.cached_tokens == 64  # the router learns prefill and hand-off of the rest only
    assert hybrid == tokens_and_last(prefill, second, "gpu")[0] == tokens_and_last(decode, second, "fpga")[0]
    assert peer.link.slots_in_use == 0 and all_free(decode)


def test_a_hybrid_request_pulls_from_the_prefill_engine_it_names_and_only_from_one_configured(
        prefill, ocl_engine, loaded_model, model_config):
    """Pools: the gateway picks a request's prefill engine; decode_fpga pulls the KV from the one named
    (connected on first use, then kept), its own when none is, and refuses an address it was not
    configured with before anything is reserved."""
    own, other = InProcessPeer(prefill), InProcessPeer(prefill)
    connected = []

    def connect(address):
        connected.append(address)
        return other

    peers = PrefillPeers(own, "10.0.0.1:50061", ("10.0.0.2:50061",), connect)
    decode = DecodeRuntime(ocl_engine, loaded_model, DecodeSettings(max_concurrency=4, queue_depth=4), peers)
    try:
        prompt = random_prompt(24, model_config.vocab_size, seed=38)
        named = [e.token for e in decode.generate(EngineRequest(tuple(prompt), GREEDY, "hybrid",
                                                                prefill_address="10.0.0.2:50061"), Cancellation())]
        assert other.skipped == [0] and own.skipped == [] and connected == ["10.0.0.2:50061"]
        again = random_prompt(24, model_config.vocab_size, seed=39)
        list(decode.generate(EngineRequest(tuple(again), GREEDY, "hybrid", prefill_address="10.0.0.2:50061"),
                             Cancellation()))
        assert connected == ["10.0.0.2:50061"] and len(other.skipped) == 2  # one connection, kept
        list(decode.generate(EngineRequest(tuple(again[:20]), GREEDY, "hybrid"), Cancellation()))
        assert len(own.skipped) == 1  # none named: its own prefill engine
        with pytest.raises(InvalidRequest, match="10.0.0.3:50061.*10.0.0.1:50061, 10.0.0.2:50061"):
            list(decode.generate(EngineRequest(tuple(prompt), GREEDY, "hybrid", prefill_address="10.0.0.3:50061"),
                                 Cancellation()))
        assert named == tokens_and_last(prefill, prompt, "gpu")[0]
        assert all_free(decode) and own.link.slots_in_use == other.link.slots_in_use == 0
    finally:
        decode.close()


def test_hybrid_reserves_decode_kv_only_after_prefill_admitted_it(decode, peer, model_config):
    prompt = random_prompt(12, model_config.vocab_size, seed=32)
    peer.watch = decode
    request = EngineRequest(tuple(prompt), GREEDY, "hybrid")
    events = list(decode.hybrid_generation(request, RequestTimings(), Cancellation()))
    assert peer.reserved_when_called == 0  # nothing held here while prefill_gpu may still refuse or queue it
    assert peer.reserved_after_grant == 1  # its blocks, reserved once the SlotGrant said it was admitted
    assert events[-1].finish_reason == "length" and len(events) == 8 and all_free(decode)


def test_more_than_eight_hand_offs_are_in_flight_at_once_while_their_memory_fits(prefill, decode, peer,
                                                                                  model_config):
    """prefill_gpu admitted 8 hand-offs at once, whatever the memory (at 32 clients hybrid's prefills
    queued behind that: TTFT p50 15 s). Now each is admitted when its KV fits: 12 short prompts all hold
    their memory at once (each waits, once admitted, until all 12 are: with a count of 8 they never
    would), then all complete with gpu mode's tokens."""
    assert prefill.settings.prefill_max_concurrency == "auto"
    n = 12
    prompts = [random_prompt(12, model_config.vocab_size, seed=60 + i) for i in range(n)]
    all_admitted = threading.Barrier(n, timeout=60)  # a bound for a hang: on a count of 8 it breaks
    peer.before_grant = all_admitted.wait  # on each request's thread, once prefill_gpu admitted it
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with ThreadPoolExecutor(n) as pool:
        hybrid = list(pool.map(lambda p: tokens_and_last(decode, p, "hybrid", params)[0], prompts))
        gpu = list(pool.map(lambda p: tokens_and_last(prefill, p, "gpu", params)[0], prompts))
    assert hybrid == gpu and all(len(t) == 4 for t in hybrid)
    assert prefill.handoff_admission.running == 0 and peer.link.slots_in_use == 0 and all_free(decode)


def test_a_long_prompt_beside_streams_that_came_by_hand_off_is_paced_from_its_first_step(decode, model_config):
    """decode_fpga's streams may all have come by hand-off (hybrid, auto): its loop then never measured
    a prompt token, and a long fpga-mode prompt arriving beside them took its first step unpaced (the
    whole budget, 64 prompt tokens beside the decodes). Every step that decodes carries at most the
    pacer's cap, and the first at most a block."""
    sched, steps = decode.loop.scheduler, []
    schedule = sched.schedule

    def recording_schedule():  # on the loop's thread: the cap as this step is chosen, then the step
        cap = sched.pacer.cap()
        out = schedule()
        if out.decodes and out.prefills:
            steps.append((cap, sum(c.num_tokens for c in out.prefills)))
        return out

    sched.schedule = recording_schedule
    stream_params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    streaming = decode.generate(EngineRequest(tuple(random_prompt(20, model_config.vocab_size, seed=70)),
                                              stream_params, "hybrid"), Cancellation())
    next(streaming)  # decoding now, its prompt's KV imported: nothing prefilled on this engine
    long_prompt = random_prompt(100, model_config.vocab_size, seed=71)
    tokens_and_last(decode, long_prompt, "fpga", SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    list(streaming)
    assert steps, "the long prompt never shared a step with the stream"
    assert all(cap is not None and n <= cap for cap, n in steps), steps
    assert steps[0][1] <= decode.loop.config.block_size, steps


def test_a_refused_prefill_never_touches_decodes_kv(decode, peer, model_config):
    peer.refuse = QueueFull("prefill queue full")
    prompt = random_prompt(20, model_config.vocab_size, seed=38)
    with pytest.raises(QueueFull):
        tokens_and_last(decode, prompt, "hybrid")
    bm = decode.loop.scheduler.block_manager
    assert bm.num_queried_tokens == 0 and decode.loop.num_unfinished == 0 and all_free(decode)


def test_a_repeated_prompt_reports_the_positions_its_prefix_cache_served(decode, model_config):
    prompt = random_prompt(40, model_config.vocab_size, seed=40)
    first = tokens_and_last(decode, prompt, "fpga")
    again = tokens_and_last(decode, prompt, "fpga")
    assert first[1].timings.cached_tokens == 0 and again[1].timings.cached_tokens == 32  # 2 whole blocks of 16
    assert again[0] == first[0]


def test_a_prefix_evicted_before_the_grant_falls_back_to_the_whole_prompt(prefill, decode, peer, model_config):
    """decode_fpga asked prefill_gpu to skip a cached 64-token prefix; the cache forgets it before
    prefill_gpu admits the request: the request is asked for again in full and decodes the same tokens."""
    shared = random_prompt(64, model_config.vocab_size, seed=39)
    first, second = shared + [5, 6, 7], shared + [21, 22, 23, 24]
    tokens_and_last(decode, first, "hybrid")
    evicted = []
    peer.before_grant = lambda: evicted.append(decode.loop.reset_prefix_cache()) if not evicted else None
    hybrid, last = tokens_and_last(decode, second, "hybrid")
    assert evicted and evicted[0] >= 4 and peer.skipped[-2:] == [64, 0]
    assert last.timings.handoff_bytes == 30 * 2 * 3 * len(second) * 64 * 4
    assert hybrid == tokens_and_last(prefill, second, "gpu")[0]
    assert peer.link.slots_in_use == 0 and all_free(decode)


def test_kv_of_another_dtype_fails_the_request_and_frees_everything(decode, peer, ocl_engine, model_config):
    peer.sends = "fp16"  # announced fp32, sends fp16: the receiver must not take the sender's word
    prompt = random_prompt(9, model_config.vocab_size, seed=33)
    with pytest.raises(HeaderMismatch, match="expects 9 tokens of fp32"):
        list(decode.hybrid_generation(EngineRequest(tuple(prompt), GREEDY, "hybrid"), RequestTimings(),
                                      Cancellation()))
    assert status_of(HeaderMismatch("x"), "decode_fpga", "r1")[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert peer.link.slots_in_use == 0 and all_free(decode)


def test_a_hand_off_failing_midway_lands_its_uploads_before_its_blocks_are_freed(decode, peer, ocl_engine,
                                                                                  model_config, monkeypatch):
    """The layers go up on a queue of their own, not ahead of the engine's next step: a hand-off that
    breaks after 5 of 30 layers waits for those 5 before its blocks are freed (a freed block may be
    written by the next prompt's step at once)."""
    calls = []
    real_import, real_finish, real_reserve = (ocl_engine.import_kv_blocks, ocl_engine.finish_import_blocks,
                                              decode.loop.reserve_remote)
    monkeypatch.setattr(ocl_engine, "import_kv_blocks", lambda *a: (calls.append("upload"), real_import(*a))[1])
    monkeypatch.setattr(ocl_engine, "finish_import_blocks", lambda: (calls.append("wait"), real_finish())[1])

    def reserve_remote(*args, **kwargs):
        stream = real_reserve(*args, **kwargs)
        real_cancel = stream.cancel
        stream.cancel = lambda: (calls.append("free"), real_cancel())[1]
        return stream

    monkeypatch.setattr(decode.loop, "reserve_remote", reserve_remote)
    peer.fail_after = 6  # the grant and 5 layers
    prompt = random_prompt(40, model_config.vocab_size, seed=35)
    with pytest.raises(HandoffFailed, match="broke after 6"):
        list(decode.hybrid_generation(EngineRequest(tuple(prompt), GREEDY, "hybrid"), RequestTimings(),
                                      Cancellation()))
    assert calls.count("upload") == 5
    last_upload = max(i for i, c in enumerate(calls) if c == "upload")
    assert "wait" in calls[last_upload:calls.index("free")], calls
    assert peer.link.slots_in_use == 0 and all_free(decode)


def test_a_cancelled_hybrid_request_stops_and_frees_everything(decode, peer, ocl_engine, model_config):
    cancel = Cancellation()
    cancel.cancel()
    with pytest.raises(Cancelled, match="during the KV hand-off"):
        tokens_and_last(decode, random_prompt(9, model_config.vocab_size, seed=34), "hybrid", cancel=cancel)
    assert peer.link.slots_in_use == 0 and all_free(decode)


def test_requests_the_runtime_refuses(decode, prefill, model_config):
    with pytest.raises(InvalidRequest, match="does not serve mode gpu"):
        tokens_and_last(decode, [1, 2], "gpu")
    with pytest.raises(PromptTooLong):
        tokens_and_last(decode, [3] * decode.max_context, "fpga")
    with pytest.raises(InvalidRequest, match="wire_dtype must be fp32 or fp16"):
        next(prefill.prefill(EngineRequest((1, 2), GREEDY, "hybrid"), "bf16", Cancellation()))


def test_cancellation_runs_callbacks_once_and_late_ones_at_once():
    cancel, calls = Cancellation(), []
    cancel.add_callback(lambda: calls.append("early"))
    cancel.cancel()
    cancel.cancel()
    cancel.add_callback(lambda: calls.append("late"))
    assert calls == ["early", "late"] and cancel.is_cancelled() and cancel.wait(0)


@pytest.mark.parametrize("exc,code", [
    (PromptTooLong("p"), grpc.StatusCode.OUT_OF_RANGE), (InvalidRequest("p"), grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull("p"), grpc.StatusCode.RESOURCE_EXHAUSTED), (ArenaFull("p"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (HeaderMismatch("p"), grpc.StatusCode.FAILED_PRECONDITION),
    (PeerUnavailable("p"), grpc.StatusCode.UNAVAILABLE), (HandoffTimedOut("p"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (Cancelled("p"), grpc.StatusCode.CANCELLED)])
def test_typed_errors_keep_their_own_message(exc, code):
    assert status_of(exc, "decode_fpga", "r1") == (code, "p")


@pytest.mark.parametrize("exc", [RuntimeError("secret at 0xdead"), HandoffFailed("prefill_gpu: secret"),
                                 ValueError("secret")])
def test_internal_failures_say_a_fixed_message_and_log_the_details(exc, caplog):
    with caplog.at_level(logging.ERROR):
        code, message = status_of(exc, "decode_fpga", "req-42")
    assert code == grpc.StatusCode.INTERNAL
    assert message == "internal error in decode_fpga (request req-42); see its log"
    assert "req-42" in caplog.text and "secret" in caplog.text


class FailsAtLayer:
    """The real torch engine with a fault injected while it prefills (nothing real fails on demand)."""

    def __init__(self, engine, layer: int):
        self._engine, self._layer = engine, layer

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, chunks, greedy, on_layer=None):
        def then_fail(layer):
            if on_layer is not None:
                on_layer(layer)
            if layer == self._layer:
                raise RuntimeError("secret: device fault at 0xdeadbeef")
        return self._engine.step(chunks, greedy, then_fail)


def serve_in_process(servicer):
    server = grpc.server(ThreadPoolExecutor(8))
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_a_failed_prefill_is_internal_on_both_engines_never_unavailable(torch_engine, ocl_engine, loaded_model, arena,
                                                                        prefill, model_config):
    broken = PrefillRuntime(FailsAtLayer(torch_engine, 3), loaded_model, prefill.settings, arena)
    pre_server, pre_address = serve_in_process(PrefillServicer(broken, "prefill_gpu"))
    peer = GrpcPrefillPeer(pre_address, model_config.model_id, timeout_s=60)
    decode = DecodeRuntime(ocl_engine, loaded_model, DecodeSettings(max_concurrency=4, queue_depth=4), peer)
    dec_server, dec_address = serve_in_process(EngineServicer(decode, "decode_fpga"))
    try:
        prompt = random_prompt(20, model_config.vocab_size, seed=35)
        with grpc.insecure_channel(pre_address) as a, grpc.insecure_channel(dec_address) as b:
            with pytest.raises(grpc.RpcError) as direct:
                list(pb_grpc.EngineStub(a).Prefill(pb.PrefillRequest(request_id="rq-1", prompt_token_ids=prompt),
                                                   timeout=60))
            with pytest.raises(grpc.RpcError) as hybrid:
                list(pb_grpc.EngineStub(b).Generate(pb.GenerateRequest(request_id="rq-2", prompt_token_ids=prompt,
                                                                       mode=pb.MODE_HYBRID), timeout=60))
        # while the loops run: a call's error can reach the client before its handler has handed the
        # request's blocks back, and a closed loop never frees them (a fresh clone's make test saw that)
        freed = all_free(decode) and all_free(broken)
    finally:
        dec_server.stop(0)
        pre_server.stop(0)
        decode.close()
        broken.close()
    assert direct.value.code() == grpc.StatusCode.INTERNAL
    assert direct.value.details() == "internal error in prefill_gpu (request rq-1); see its log"
    assert hybrid.value.code() == grpc.StatusCode.INTERNAL
    assert hybrid.value.details() == "internal error in decode_fpga (request rq-2); see its log"
    assert freed and arena.slots_in_use == 0


@pytest.mark.parametrize("mode", ["gpu", "hybrid"])
def test_n_choices_cost_one_prefill_the_others_start_from_its_cached_blocks(prefill, decode, model_config, mode):
    runtime = prefill if mode == "gpu" else decode
    prompt = random_prompt(40, model_config.vocab_size, seed=901 if mode == "gpu" else 902)  # never seen before
    bm = runtime.loop.scheduler.block_manager
    hits = bm.num_hit_tokens
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=3, ignore_eos=True, n=4)
    events = list(runtime.generate(EngineRequest(tuple(prompt), params, mode), Cancellation()))
    assert sorted(ev.index for ev in events if ev.finish_reason) == [0, 1, 2, 3]
    assert len(events) == 12
    full = len(prompt) // bm.block_size * bm.block_size
    assert bm.num_hit_tokens - hits == 3 * full  # choices 1..3 took choice 0's full blocks
    assert all_free(runtime)
