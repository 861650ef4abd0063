"""How the gateway is served: uvicorn, with its connection limits and timeouts from the settings.

`limit_concurrency` caps connections and requests at once (past it uvicorn answers 503 at once,
before the app), `keep_alive_timeout_s` closes idle keep-alive connections; the body's size
and read deadline are the app's own (body_limit.py).
"""
from __future__ import annotations

import uvicorn

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings


def config(settings: GatewaySettings) -> uvicorn.Config:
    return uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                          log_level=settings.log_level.lower(), timeout_graceful_shutdown=10,
                          limit_concurrency=settings.limit_concurrency,
                          timeout_keep_alive=settings.keep_alive_timeout_s)
