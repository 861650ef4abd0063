"""`GET /debug/router`: what the router believes now (fitted stage coefficients, online
corrections, engine queues, exploration counts), for people and dashboards.

The gateway mounts it with `app.include_router(debug_routes(lambda: <its Router>))`, adding
its own auth dependencies when it has them.
"""
from __future__ import annotations

from typing import Callable

from fastapi import APIRouter

from services.gateway.router import Router


def debug_routes(get_router: Callable[[], Router]) -> APIRouter:
    """An APIRouter serving `get_router().snapshot()` as JSON."""
    routes = APIRouter()

    @routes.get("/debug/router")
    async def router_state() -> dict:
        return get_router().snapshot()

    return routes
