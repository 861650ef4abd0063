"""A hybrid request waits for its hand-off as long as its own deadline allows, not a fixed one.

decode_fpga's Prefill call to prefill_gpu had a fixed deadline (HYBRIDSERVE_DECODE_HANDOFF_TIMEOUT_S,
120 s): at 64 clients 14 of 256 hybrid requests queued past it and answered 504 while their own
deadline (the gateway's 600 s) had long to run. Both engines are real (torch on the CPU, OpenCL on
PoCL), prefill_gpu served over gRPC on loopback; the peer's own timeout is made far too short, so
only the request's deadline can carry the hand-off through.
"""
from __future__ import annotations

import time

import pytest

from services.decode_fpga.hybrid import DecodeRuntime
from services.decode_fpga.server import GrpcPrefillPeer
from services.decode_fpga.settings import DecodeSettings
from services.engine.requests import Cancellation, EngineRequest
from services.errors import HandoffTimedOut
from services.engine.sampling import SamplingParams
from services.kv.arena import Arena
from services.prefill_gpu.runtime import PrefillRuntime
from services.prefill_gpu.server import PrefillServicer
from services.prefill_gpu.settings import PrefillSettings
from tests.conftest import random_prompt
from tests.stack.test_engine_runtime import serve_in_process

TOO_SHORT_S = 0.001  # no Prefill call finishes within it


@pytest.fixture(scope="module")
def hybrid_over_grpc(torch_engine, ocl_engine, loaded_model):
    arena = Arena(8 << 20)
    prefill = PrefillRuntime(torch_engine, loaded_model, PrefillSettings(wire_dtype="fp32", profile_at_start=False),
                             arena)
    server, address = serve_in_process(PrefillServicer(prefill, "prefill_gpu"))
    peer = GrpcPrefillPeer(address, loaded_model.config.model_id, timeout_s=TOO_SHORT_S)
    decode = DecodeRuntime(ocl_engine, loaded_model, DecodeSettings(max_concurrency=2, queue_depth=2), peer)
    try:
        yield prefill, decode
    finally:
        server.stop(0)
        decode.close()
        prefill.close()
        arena.close()


def test_the_request_deadline_bounds_the_handoff_not_the_fixed_timeout(hybrid_over_grpc, model_config):
    prefill, decode = hybrid_over_grpc
    prompt = random_prompt(24, model_config.vocab_size, seed=77)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [ev.token for ev in prefill.generate(EngineRequest(tuple(prompt), params, "gpu"), Cancellation())]
    got = [ev.token for ev in decode.generate(EngineRequest(tuple(prompt), params, "hybrid"),
                                                 Cancellation(time.monotonic() + 120))]
    assert got == want


def test_without_a_request_deadline_the_fixed_timeout_still_holds(hybrid_over_grpc, model_config):
    _, decode = hybrid_over_grpc
    prompt = random_prompt(24, model_config.vocab_size, seed=78)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(HandoffTimedOut):
        list(decode.generate(EngineRequest(tuple(prompt), params, "hybrid"), Cancellation()))


class GrantThenDeadline:
    """prefill_gpu's side of a Prefill call whose deadline passed just after it granted a slot: the
    grant was on the wire, the slot freed (its header zeroed) by the time decode_fpga read it, then the
    call's end (DEADLINE_EXCEEDED, as error_from_peer gives it). The real arena and shm receiver; only
    the call's timing is played, since the race it lost once in CI cannot be forced over gRPC."""

    def __init__(self, arena: Arena):
        self.arena = arena

    def wire_dtype(self) -> str:
        return "fp32"

    def receiver(self, engine, seq, expected):
        from services.kv.arena import ArenaReader
        from services.kv.shm import ShmReceiver

        return ShmReceiver(ArenaReader(self.arena.name, self.arena.path.parent), engine, seq, expected)

    def prefill(self, request, wire_dtype, cancel, skip_tokens=0):
        from services.kv.handoff import SlotGrant

        slot = self.arena.allocate(1 << 16, timeout=1.0)
        self.arena.free(slot)  # the call ended: prefill_gpu freed what it granted
        yield SlotGrant(slot.offset, slot.size, len(request.prompt_ids) - skip_tokens, wire_dtype)
        raise HandoffTimedOut("prefill_gpu: Deadline Exceeded")

    def close(self) -> None:
        pass


def test_a_slot_freed_because_the_call_timed_out_is_a_timeout_not_an_engine_failure(ocl_engine, loaded_model,
                                                                                   model_config):
    arena = Arena(1 << 20)
    decode = DecodeRuntime(ocl_engine, loaded_model, DecodeSettings(max_concurrency=2, queue_depth=2),
                           GrantThenDeadline(arena))
    try:
        prompt = random_prompt(24, model_config.vocab_size, seed=79)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with pytest.raises(HandoffTimedOut):
            list(decode.generate(EngineRequest(tuple(prompt), params, "hybrid"), Cancellation()))
        deadline = time.monotonic() + 10  # the loop thread takes the cancelled reservation back
        while decode.loop.scheduler.num_waiting_for_remote_kv and time.monotonic() < deadline:
            time.sleep(0.01)
        assert decode.loop.scheduler.num_waiting_for_remote_kv == 0  # nothing left reserved
    finally:
        decode.close()
        arena.close()
