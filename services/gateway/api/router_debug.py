"""`GET /debug/router`: what the router believes now (fitted stage coefficients, online
corrections, engine queues, exploration counts), for people and dashboards; `GET /debug/kv_index`:
what the gateway believes each engine holds in its prefix cache (kv_index.py: the events' epoch and
cursor, the number of block hashes), the picture prefix-aware placement reads; `GET /debug/planner`:
the planner's demand, targets and desired replicas (planner.py) beside each pool's engines, what
`hybridserve up --autoscale` decides on.

The gateway mounts them with `app.include_router(debug_routes(lambda: <its Router>, lambda: <its
Pairs>))`, adding its own auth dependencies when it has them.
"""
from __future__ import annotations

from typing import Callable

from fastapi import APIRouter

from services.gateway.api.pool_admin import pools_state
from services.gateway.fleet.planner import snapshot
from services.gateway.routing.router import Router
from services.modes import ENGINE_NAMES


def debug_routes(get_router: Callable[[], Router], get_pairs: Callable[[], object] | None = None,
                 get_planner: Callable[[], object] | None = None) -> APIRouter:
    """An APIRouter serving `get_router().snapshot()` and, given the pairs, their KV index as JSON (and
    given the planner too, its figures)."""
    routes = APIRouter()

    @routes.get("/debug/router")
    async def router_state() -> dict:
        return get_router().snapshot()

    if get_pairs is not None:
        @routes.get("/debug/kv_index")
        async def kv_index_state() -> dict:
            """{"pairs": {pair: {"prefill_gpu": {...}, "decode_fpga": {...}}}}: per engine its up
            state and the index's picture of its cache (an engine found down holds nothing)."""
            pairs = get_pairs()
            out = {}
            for p, clients in sorted(pairs.members.items()):
                blocks = getattr(clients, "blocks", {})
                out[str(p)] = {ENGINE_NAMES[e]: {"up": bool(clients.up.get(e)), **b.snapshot()}
                               for e, b in blocks.items()}
            return {"pairs": out}

    if get_pairs is not None and get_planner is not None:
        @routes.get("/debug/planner")
        async def planner_state() -> dict:
            """{"desired": {pool: n}, "demand", "targets", "calibrated", "pools": {pool: [engine, ...]}}."""
            pairs = get_pairs()
            return {**snapshot(get_planner(), get_router(), pairs), "pools": pools_state(pairs)}

    return routes
