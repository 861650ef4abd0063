"""How the gateway is served: uvicorn, with its connection limits and timeouts from the settings,
and a graceful drain on SIGTERM.

`limit_concurrency` caps connections and requests at once (past it uvicorn answers 503 at once,
before the app), `keep_alive_timeout_s` closes idle keep-alive connections; the body's size
and read deadline are the app's own (body_limit.py).

`DrainingServer` makes uvicorn's first SIGTERM or SIGINT a drain (drain.py) instead of an
immediate shutdown: the gateway keeps listening and answering 503 to new work while the requests
in flight finish, up to `drain_grace_s`; then uvicorn shuts down as it always does. A second
signal ends the drain at once.
"""
from __future__ import annotations

import uvicorn

from services.gateway.api.app import create_app
from services.gateway.api.drain import Drain
from services.gateway.settings import GatewaySettings

# after the drain, uvicorn's own wait for connections: they are idle by then, or ended by the drain
SHUTDOWN_AFTER_DRAIN_S = 5


def config(settings: GatewaySettings) -> uvicorn.Config:
    return uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                          log_level=settings.log_level.lower(), timeout_graceful_shutdown=SHUTDOWN_AFTER_DRAIN_S,
                          limit_concurrency=settings.limit_concurrency,
                          timeout_keep_alive=settings.keep_alive_timeout_s)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with the first exit signal turned into the app's drain."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig, frame) -> None:
        if self.drain.draining:  # a second signal: stop waiting
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # uvicorn raises it again once it has shut down
        self.drain.begin()

    async def on_tick(self, counter: int) -> bool:
        if self.drain.finished():
            self.should_exit = True
        return await super().on_tick(counter)


def server(settings: GatewaySettings) -> DrainingServer:
    cfg = config(settings)
    return DrainingServer(cfg, cfg.app.state.drain)
