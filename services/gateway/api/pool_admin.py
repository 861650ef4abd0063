"""Pools that change while the gateway runs: the routes `hybridserve up --autoscale` calls to add an
engine to a pool, drain one and remove it (it decides on `GET /debug/planner`, router_debug.py).

    GET  /admin/pools                    each pool's engines: up, draining, calls this gateway has open
    POST /admin/pools/{pool}/add         {"address": "host:port"}: the engine joins (a draining one serves again)
    POST /admin/pools/{pool}/drain       {"address": ...}: no new call goes to it; those open run on
    POST /admin/pools/{pool}/remove      {"address": ..., "force": false}: it leaves (409 while calls are
                                         open, unless forced: those are then migrated like a lost engine's)

Pools are otherwise the gateway's settings (HYBRIDSERVE_GATEWAY_PREFILL_POOL, _DECODE_POOL), read at
start, so these routes exist only when `pool_admin` is set (`up --autoscale` sets it for its gateway).
Changing what the gateway routes to is an operator's act, so on top of the API key (when one is set)
only a client on loopback is heard: the supervisor that starts the engines runs on the same host. A
gateway started again forgets what was added: `up` adds its engines again (stack_autoscale.py).
"""
from __future__ import annotations

import asyncio
from typing import Callable, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.api import openapi
from services.gateway.api.auth import is_loopback
from services.gateway.fleet.pairs import Address, Engines, Pairs
from services.gateway.protocol.errors import APIError
from services.gateway.protocol.openai_format import ErrorBody
from services.modes import ENGINES

POOLS = ("prefill", "decode")  # side 0 and 1 of a pair's address
Pool = Literal["prefill", "decode"]
# what the routes answer besides 200, for the OpenAPI document
RESPONSES = {**openapi.errors(400, *openapi.EDGE), **{
    status: {"model": ErrorBody, "description": text} for status, text in (
        (403, "the client is not on the gateway's host"), (404, "the engine is not in the pool"),
        (409, "the last engine of its pool, calls still open, or a gateway of pairs, not pools"))}}


class PoolMember(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str = Field(pattern=r"^.+:\d+$", description="the engine's gRPC address, host:port")
    force: bool = False  # remove only: even with calls open


def pool_routes(get_pairs: Callable[[], Pairs], get_connect: Callable[[], Callable[[Address], Engines]]
                ) -> APIRouter:
    routes = APIRouter()

    @routes.get("/admin/pools")
    async def pools(request: Request) -> dict:
        _loopback(request)
        return pools_state(get_pairs())

    @routes.post("/admin/pools/{pool}/add")
    async def add(pool: Pool, member: PoolMember, request: Request) -> dict:
        pairs, side = _pooled(request, get_pairs(), pool)
        return {"pairs": pairs.join_pool(side, member.address, get_connect())}

    @routes.post("/admin/pools/{pool}/drain")
    async def drain(pool: Pool, member: PoolMember, request: Request) -> dict:
        pairs, side = _pooled(request, get_pairs(), pool, member.address)
        return {"pairs": pairs.drain_pool_member(side, member.address),
                "calls_open": pairs.calls_on(side, member.address)}

    @routes.post("/admin/pools/{pool}/remove")
    async def remove(pool: Pool, member: PoolMember, request: Request) -> dict:
        pairs, side = _pooled(request, get_pairs(), pool, member.address)
        if len(pairs.pool(side)) == 1:
            raise APIError(409, f"{member.address} is the {pool} pool's last engine", "address", "last_engine")
        calls = pairs.calls_on(side, member.address)
        if calls and not member.force:
            raise APIError(409, f"{member.address} has {calls} call(s) open; drain it first, or force",
                           "address", "calls_open")
        removed = pairs.leave_pool(side, member.address)
        await asyncio.gather(*(c.close() for c in removed if hasattr(c, "close")))
        return {"removed_pairs": len(removed), "calls_open": calls}

    return routes


def _loopback(request: Request) -> None:
    host = request.client.host if request.client else ""
    if not is_loopback(host):
        raise APIError(403, "pools are changed only from the gateway's own host", code="not_loopback")


def _pooled(request: Request, pairs: Pairs, pool: str, member: str | None = None) -> tuple[Pairs, int]:
    _loopback(request)
    if not pairs.pools:
        raise APIError(409, "this gateway serves pairs, not pools (HYBRIDSERVE_GATEWAY_PREFILL_POOL, _DECODE_POOL)",
                       "pool", "not_pools")
    side = POOLS.index(pool)
    if member is not None and member not in pairs.pool(side):
        raise APIError(404, f"{member} is not in the {pool} pool", "address", "not_in_pool")
    return pairs, side


def pools_state(pairs: Pairs) -> dict:
    """{pool: [{address, up, draining, calls_open, pairs}]}; `up`: as any of its pairs' clients saw it."""
    out = {}
    for side, pool in enumerate(POOLS):
        engine = ENGINES[side]  # prefill_gpu, decode_fpga
        out[pool] = [{"address": a, "pairs": pairs.pairs_with(side, a), "draining": (side, a) in pairs.draining,
                      "calls_open": pairs.calls_on(side, a),
                      "up": any(pairs.members[p].up.get(engine) for p in pairs.pairs_with(side, a))}
                     for a in pairs.pool(side)]
    return out
