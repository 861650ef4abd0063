"""The gateway's view of the two engines: async gRPC channels, health, Info, Profile and Generate.

Engines are keyed "gpu" (prefill_gpu) and "fpga" (decode_fpga), as in services/modes.py.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.fleet.kv_index import EngineBlocks
from services.modes import ENGINE_NAMES, ENGINES
from services.rpc.engine_token import RECONNECT_OPTIONS, aio_interceptors
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class EngineClients:
    def __init__(self, prefill_address: str, decode_address: str, engine_token: str | None = None,
                 label: str = ""):
        self.label = label  # in the log, which pair this is ("pair 1: "), when there are several
        addresses = {"gpu": prefill_address, "fpga": decode_address}
        self.channels = {e: grpc.aio.insecure_channel(addresses[e], options=RECONNECT_OPTIONS,
                                                      interceptors=aio_interceptors(engine_token)) for e in ENGINES}
        self.stubs = {e: pb_grpc.EngineStub(ch) for e, ch in self.channels.items()}
        self._health = {e: health_pb2_grpc.HealthStub(ch) for e, ch in self.channels.items()}
        self.up = {e: False for e in ENGINES}  # as of the last health check
        self.info: dict[str, pb.InfoResponse] = {}
        self.profiles: dict[str, list[dict]] = {}
        self.blocks = {e: EngineBlocks() for e in ENGINES}  # what each holds in its prefix cache (kv_index.py)

    async def check(self, engine: str) -> bool:
        try:
            reply = await self._health[engine].Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            up = reply.status == health_pb2.HealthCheckResponse.SERVING
            if up and engine not in self.info:
                self._took_info(engine, await self.stubs[engine].Info(self.blocks[engine].cursor(), timeout=5.0))
        except grpc.RpcError:
            up = False
        if not up:
            self.blocks[engine].clear()
        if up != self.up[engine]:
            log.info("%s%s is %s", self.label, ENGINE_NAMES[engine], "up" if up else "DOWN")
        self.up[engine] = up
        return up

    async def check_all(self) -> dict[str, bool]:
        await asyncio.gather(*(self.check(e) for e in self.up))
        return dict(self.up)

    async def refresh_load(self) -> None:
        """Info again from every engine that is up: its batch and queue right now (the router's load)."""
        async def one(engine: str) -> None:
            try:
                self._took_info(engine, await self.stubs[engine].Info(self.blocks[engine].cursor(), timeout=1.0))
            except grpc.RpcError:
                pass  # the next health check says whether it is gone
        await asyncio.gather(*(one(e) for e, up in self.up.items() if up))

    def _took_info(self, engine: str, info: pb.InfoResponse) -> None:
        self.blocks[engine].apply(info)
        info.ClearField("kv_events")  # applied; the load fields are what the rest reads
        self.info[engine] = info

    async def fetch_profile(self, engine: str) -> list[dict] | None:
        try:
            reply = await self.stubs[engine].Profile(pb.ProfileRequest(), timeout=600.0)
        except grpc.RpcError as exc:
            log.warning("no profile from %s: %s", ENGINE_NAMES[engine], exc.code().name)
            return None
        samples = [{"stage": s.stage, "device": s.device, "n_in": s.n_in, "n_out": s.n_out, "seconds": s.seconds,
                    "quiet": reply.quiet} for s in reply.samples]
        self.profiles[engine] = samples
        return samples

    def generate(self, engine: str, request: pb.GenerateRequest, timeout: float):
        """Open a Generate call (server streaming): `await call.read()` per message, `call.cancel()`."""
        return self.stubs[engine].Generate(request, timeout=timeout)

    def context_of(self, engine: str) -> int:
        info = self.info.get(engine)
        return info.max_context if info else 0

    async def close(self) -> None:
        await asyncio.gather(*(ch.close() for ch in self.channels.values()))
