"""Graceful drain: on SIGTERM the gateway stops taking work and lets the work in flight finish.

* `Drain` is the state: draining or not, since when, how many requests are in flight, and
  whether the grace has run out.
* `DrainGate`, a pure ASGI middleware outside everything else, counts the requests in flight
  until their response's last byte. Once draining it answers every new request but /health and
  /metrics with 503 (OpenAI error JSON, `Retry-After`, `Connection: close`); /health itself says
  503 "draining" (app.py), so a load balancer stops sending work here at once.
* When the grace runs out with requests still in flight, the gate ends each of them itself: a
  stream that has started gets an error event and `data: [DONE]` (never a stream that just
  stops), a response that has not started gets the 503. Ending a request cancels its engine call.
* server.DrainingServer turns uvicorn's first SIGTERM or SIGINT into `Drain.begin`, keeps
  listening (new requests get their 503 rather than a refused connection) until `finished`, then
  lets uvicorn shut down as usual.
"""
from __future__ import annotations

import asyncio
import logging
import time

from services.gateway.protocol.errors import RETRY_AFTER_S, error_body
from services.gateway.protocol.openai_format import SSE_DONE, sse

log = logging.getLogger(__name__)

ALWAYS_OPEN = frozenset({"/health", "/readyz", "/livez", "/metrics"})  # answered while draining: probes, scrapers
_SHUTTING_DOWN = "the server is shutting down; retry on another instance"


class Drain:
    """The gateway's drain state; `grace_s`: how long requests in flight may run once it began."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.draining = False
        self.in_flight = 0
        self._began: float | None = None
        self.expired = False  # the grace has run out: the gates end what is left
        self._waiters: set[asyncio.Future] = set()  # futures, not an Event: no loop is bound at construction

    def begin(self) -> None:
        if not self.draining:
            self.draining, self._began = True, time.monotonic()
            log.warning("draining: %d request(s) in flight get up to %g s to finish; new ones get 503",
                        self.in_flight, self.grace_s)

    def finished(self) -> bool:
        """Whether the server may shut down now (called on uvicorn's tick); sets `expired` past the grace."""
        if not self.draining:
            return False
        if self.in_flight == 0:
            return True
        if time.monotonic() - self._began >= self.grace_s and not self.expired:
            log.warning("drain grace of %g s over: ending %d request(s) still in flight", self.grace_s,
                        self.in_flight)
            self.expired = True
            for waiter in list(self._waiters):
                if not waiter.done():
                    waiter.set_result(None)
        return False

    def until_expired(self) -> asyncio.Future:
        """A future of the running loop, done when the grace runs out."""
        waiter = asyncio.get_running_loop().create_future()
        if self.expired:
            waiter.set_result(None)
        else:
            self._waiters.add(waiter)
            waiter.add_done_callback(self._waiters.discard)
        return waiter


class DrainGate:
    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] not in ALWAYS_OPEN:
            await _refuse(send)
            return
        self.drain.in_flight += 1
        try:
            await self._until_done_or_expired(scope, receive, send)
        finally:
            self.drain.in_flight -= 1

    async def _until_done_or_expired(self, scope, receive, send) -> None:
        response = _ResponseState(send)
        request = asyncio.ensure_future(self.app(scope, receive, response.send))
        expired = self.drain.until_expired()
        try:
            await asyncio.wait({request, expired}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this task itself was cancelled (uvicorn's own shutdown timeout)
            request.cancel()
            raise
        finally:
            expired.cancel()
        if request.done():
            request.result()  # the app's own exception, if any, goes to uvicorn as before
            return
        request.cancel()  # closes the response's generator: the engine call is cancelled
        try:
            await request
        except asyncio.CancelledError:
            pass
        await response.end_for_shutdown()


class _ResponseState:
    """Wraps `send` to know how far the response got, so a request ended by the drain ends cleanly."""

    def __init__(self, send):
        self._send, self.started, self.ended, self.event_stream = send, False, False, False

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.event_stream = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self._send(message)

    async def end_for_shutdown(self) -> None:
        if not self.started:
            await _refuse(self._send)
        elif not self.ended:
            tail = sse(error_body(503, _SHUTTING_DOWN, code="shutting_down")) + SSE_DONE if self.event_stream else ""
            await self._send({"type": "http.response.body", "body": tail.encode(), "more_body": False})


async def _refuse(send) -> None:
    payload = error_body(503, _SHUTTING_DOWN, code="shutting_down").model_dump_json().encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})
