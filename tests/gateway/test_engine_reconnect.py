"""The gateway's engine channels retry a connection every 2 s at most: an engine that comes up after
the gateway has tried it for a while is seen within a health interval or two, not after gRPC's
default backoff (after 32 s of refusals its next attempt came 7 and 13 s after the engine began
serving, measured without the option). A real gRPC server on loopback; the test mostly waits, so it
runs in the stacks lane (tests/conftest.py)."""
from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.gateway.fleet.engine_client import EngineClients
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc
from tests.services_harness import free_port

REFUSED_FOR_S = 32.0  # gRPC's default backoff: attempts near 26 and 43 s, none in the 4 s after this


class InfoOnly(pb_grpc.EngineServicer):
    """What the gateway asks an engine it finds up (the rest is UNIMPLEMENTED)."""

    def Info(self, request, context):
        return pb.InfoResponse()


def serve_health(port: int) -> grpc.Server:
    """An engine's gRPC face as the gateway's health loop sees it: health SERVING and Info."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    pb_grpc.add_EngineServicer_to_server(InfoOnly(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def test_an_engine_that_starts_late_is_seen_within_seconds_of_serving():
    port = free_port()

    async def scenario() -> float:
        clients = EngineClients(f"127.0.0.1:{free_port()}", f"127.0.0.1:{port}")
        try:
            until = time.monotonic() + REFUSED_FOR_S
            while time.monotonic() < until:  # the gateway's health loop against an engine still loading
                assert not await clients.check("fpga")
                await asyncio.sleep(1.0)
            server = serve_health(port)
            try:
                started = time.monotonic()
                while not await clients.check("fpga"):
                    assert time.monotonic() - started < 30, "the engine was never seen"
                    await asyncio.sleep(0.25)
                return time.monotonic() - started
            finally:
                server.stop(None)
        finally:
            await asyncio.gather(*(ch.close() for ch in clients.channels.values()))

    seen_after = asyncio.run(scenario())
    assert seen_after < 4.0, f"seen {seen_after:.1f} s after it began serving"
