"""The request body limit and the body-read deadline, enforced on the bytes as they arrive.

A pure ASGI middleware, outside everything else: it reads a request's body before any route
sees it, counting bytes as they come in.

* A `Content-Length` over `max_bytes` is refused before one byte of the body is read.
* A chunked body (`Transfer-Encoding: chunked`, no length up front) is refused as soon as its
  running count passes `max_bytes`; the rest of it is never read.
* A body that has not arrived whole within `read_timeout_s` is refused with 408, so a client
  trickling bytes cannot hold a connection and a worker open.

Refusals are OpenAI error JSON (errors.error_body) sent with `Connection: close`: the server
stops reading that connection, whatever the client still sends. A body within the limit is
handed to the app from memory, then the connection's own messages (a disconnect) follow.
"""
from __future__ import annotations

import asyncio

from services.gateway.protocol.errors import error_body


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_bytes: int, read_timeout_s: float):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (_content_length(scope) or 0) > self.max_bytes:
            await self._too_large(send)
            return
        try:
            async with asyncio.timeout(self.read_timeout_s):
                body = await self._read(receive)
        except _TooLarge:
            await self._too_large(send)
            return
        except TimeoutError:
            await _refuse(send, 408, f"the request body did not arrive within {self.read_timeout_s:g} s",
                          "body_read_timeout")
            return
        except _ClientGone:
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive) -> bytes:
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send) -> None:
        await _refuse(send, 413, f"request body over {self.max_bytes} bytes", "body_too_large")


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None  # the HTTP parser has refused a malformed one
    return None


def _replay(body: bytes, receive):
    """A `receive` that gives the app the body already read, then the connection's own messages."""
    given = False

    async def replay():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(send, status: int, message: str, code: str) -> None:
    payload = error_body(status, message, code=code).model_dump_json().encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})
