"""The engines' gRPC edge on a real prefill_gpu process over loopback: the shared token, reflection
off by default, and health checks that a flood of held calls never starves.

prefill_gpu holds a thread for every admitted call, running or queued, in two admissions
(gpu-mode Generate and the hybrid Prefill); a finished Prefill keeps its call open until the
reader ends it. Sized only for the first admission, its threads ran out before its queues did,
and health checks waited behind them: the gateway then saw the engine down.
"""
from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.prefill_gpu.settings import PrefillSettings
from services.rpc.engine_token import engine_channel
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc
from tests.services_harness import Service

TOKEN = "s3cret-engine-token"
HANDOFF_QUEUE = 12
ENV = {"HYBRIDSERVE_ENGINE_TOKEN": TOKEN, **{PrefillSettings.env_name(k): str(v) for k, v in {
    "max_num_seqs": 1, "queue_depth": 1, "kv_cache_mb": 64, "prefill_max_concurrency": 1,
    "prefill_queue_depth": HANDOFF_QUEUE,
    "slot_hold_s": 300, "arena_bytes": 32 << 20}.items()}}


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edge")
    svc = Service("services.prefill_gpu", {**ENV, PrefillSettings.env_name("profile_cache"): str(tmp / "profile")},
                  tmp / "prefill.log").start()
    try:
        yield svc.wait_healthy(timeout=300)
    finally:
        svc.stop()


def health(address: str, timeout: float = 10) -> int:
    with grpc.insecure_channel(address) as ch:  # no token: health is exempt
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def test_calls_without_the_token_are_unauthenticated(prefill):
    with grpc.insecure_channel(prefill.address) as ch:
        stub = pb_grpc.EngineStub(ch)
        for call in (lambda: stub.Info(pb.InfoRequest(), timeout=10),
                     lambda: list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6]), timeout=10)),
                     lambda: stub.Info(pb.InfoRequest(), timeout=10, metadata=[("authorization", "Bearer wrong")])):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert TOKEN not in (err.value.details() or "")
    assert health(prefill.address) == health_pb2.HealthCheckResponse.SERVING
    with engine_channel(prefill.address, TOKEN) as ch:
        stub = pb_grpc.EngineStub(ch)
        assert stub.Info(pb.InfoRequest(), timeout=10).engine == "torch"
        tokens = [t for m in stub.Generate(pb.GenerateRequest(
            prompt_token_ids=[5, 6], sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)), timeout=60)
            for t in m.token_ids]
        assert len(tokens) == 2


def test_reflection_is_off_unless_asked_for(prefill):
    with engine_channel(prefill.address, TOKEN) as ch:
        with pytest.raises(grpc.RpcError) as err:
            next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _prefill(stub, i: int):
    """A Prefill call, started and not read: prefill_gpu holds it open (running, then holding its slot
    for the reader, or queued behind the running one), one server thread each."""
    return stub.Prefill(pb.PrefillRequest(prompt_token_ids=[7 + i, 8, 9], sampling=pb.SamplingParams(max_tokens=1)),
                        timeout=600)


def _wait_for(probe, what: str, within: float = 120.0) -> None:
    """Poll until `probe()`; a bound for a hang, not a speed check."""
    deadline = time.monotonic() + within
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"never {what}")
        time.sleep(0.2)


def test_a_flood_of_held_calls_never_starves_health(prefill):
    with engine_channel(prefill.address, TOKEN) as ch:
        stub = pb_grpc.EngineStub(ch)
        held = [_prefill(stub, i) for i in range(1 + HANDOFF_QUEUE)]  # the hand-off admission: 1 running + queue
        try:
            _wait_for(lambda: prefill.metric("hybridserve_engine_queue_depth") == HANDOFF_QUEUE,
                      f"{HANDOFF_QUEUE} Prefill calls queued: some never got a server thread")
            assert health(prefill.address) == health_pb2.HealthCheckResponse.SERVING
            # beyond every queue: refused at once, by the server's call limit or the admission
            for i in range(20):
                with pytest.raises(grpc.RpcError) as err:
                    next(_prefill(stub, 100 + i))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert health(prefill.address) == health_pb2.HealthCheckResponse.SERVING
        finally:
            for call in held:
                call.cancel()
        _wait_for(lambda: prefill.metric("hybridserve_kv_arena_slots_in_use") == 0, "every slot freed")
