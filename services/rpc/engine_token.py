"""The shared token on the engines' gRPC edge (HYBRIDSERVE_ENGINE_TOKEN): the server's check and
what every client of an engine sends; and how such a client reconnects (RECONNECT_OPTIONS).

Off when no token is set (loopback, one host). Across containers every engine checks it:
a call without `authorization: Bearer <token>` ends UNAUTHENTICATED before it reaches the
servicer. Health checks are exempt, so orchestrators probe without the secret.
"""
from __future__ import annotations

import collections
import hmac

import grpc

METADATA_KEY = "authorization"
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def _bearer(token: str) -> tuple[str, str]:
    return METADATA_KEY, f"Bearer {token}"


class TokenCheck(grpc.ServerInterceptor):
    """Lets a call through only with the token (compared in constant time), health always."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("an empty engine token checks nothing")
        self._expected = _bearer(token)[1].encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this engine needs HYBRIDSERVE_ENGINE_TOKEN")

        # a unary handler ends any kind of call with its status before a message is read
        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return continuation(handler_call_details)
        sent = [v for k, v in handler_call_details.invocation_metadata or () if k == METADATA_KEY]
        value = sent[0].encode() if sent and isinstance(sent[0], str) else b""
        if len(sent) == 1 and hmac.compare_digest(value, self._expected):
            return continuation(handler_call_details)
        return self._deny


def with_token(metadata, token: str) -> list[tuple[str, str]]:
    return [*(m for m in (metadata or ()) if m[0] != METADATA_KEY), _bearer(token)]


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                    "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _SendToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    def _details(self, d):
        return _Details(d.method, d.timeout, with_token(d.metadata, self.token), d.credentials,
                        getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


# gRPC's reconnect backoff grows to 120 s by default: a gateway started beside its engines (a minute of
# model loads and profile sweeps on a busy 2-core machine) saw decode_fpga 18 s after it began serving,
# and an engine restarted after a crash would be seen as late. Engines are on loopback or one cluster
# hop away, where a connection attempt every 2 s at most costs nothing.
RECONNECT_OPTIONS = (("grpc.max_reconnect_backoff_ms", 2000),)


def engine_channel(address: str, token: str | None) -> grpc.Channel:
    """A blocking channel to an engine that sends the token with every call (when there is one)."""
    channel = grpc.insecure_channel(address, options=RECONNECT_OPTIONS)
    return grpc.intercept_channel(channel, _SendToken(token)) if token else channel


class _AioTokenDetails:
    def __init__(self, token: str):
        self.token = token

    def _details(self, d):
        return grpc.aio.ClientCallDetails(d.method, d.timeout, with_token(d.metadata, self.token), d.credentials,
                                          d.wait_for_ready)


class _AioUnaryUnaryToken(_AioTokenDetails, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioUnaryStreamToken(_AioTokenDetails, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def aio_interceptors(token: str | None) -> list:
    """The interceptors an asyncio channel to an engine needs to send the token (none without one). One
    object per kind of call: an asyncio channel files an interceptor under the first kind it implements."""
    return [_AioUnaryUnaryToken(token), _AioUnaryStreamToken(token)] if token else []
