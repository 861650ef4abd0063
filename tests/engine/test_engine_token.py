"""The engine token's server check and both kinds of client (blocking and asyncio), on real gRPC over
loopback, for every kind of call the engines' clients make (unary and server streaming)."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.rpc.engine_token import TokenCheck, aio_interceptors, engine_channel

TOKEN = "t0ken"


@pytest.fixture(scope="module")
def address():
    server = grpc.server(ThreadPoolExecutor(4), interceptors=[TokenCheck(TOKEN)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.T", {
        "Stream": grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter([b"a", req])),
        "Unary": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req[::-1])})])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def calls(channel):
    return channel.unary_unary("/test.T/Unary"), channel.unary_stream("/test.T/Stream")


@pytest.mark.parametrize("token", [None, "wrong"])
def test_without_the_token_every_call_is_unauthenticated_but_health(address, token):
    with engine_channel(address, token) as ch:
        unary, stream = calls(ch)
        for call in (lambda: unary(b"xy", timeout=5), lambda: list(stream(b"xy", timeout=5))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_blocking_client_sends_it(address):
    with engine_channel(address, TOKEN) as ch:
        unary, stream = calls(ch)
        assert unary(b"xy", timeout=5) == b"yx"
        assert list(stream(b"xy", timeout=5)) == [b"a", b"xy"]


def test_the_asyncio_client_sends_it(address):
    async def run():
        async with grpc.aio.insecure_channel(address, interceptors=aio_interceptors(TOKEN)) as ch:
            unary, stream = calls(ch)
            call = stream(b"xy", timeout=5)
            return await unary(b"xy", timeout=5), [await call.read(), await call.read()]

    assert asyncio.run(run()) == (b"yx", [b"a", b"xy"])


def test_an_empty_token_is_refused():
    with pytest.raises(ValueError, match="empty"):
        TokenCheck("")
