"""Typed engine errors → gRPC statuses, in one table; and a peer engine's statuses back to errors.

A typed error's message is ours (services/errors.py) and goes to the client as it is.
Anything else, and `HandoffFailed`, is INTERNAL with a fixed message naming the
request id; the details go to this process's log under that id, never across
the wire. The gateway then answers its own fixed message for INTERNAL.
"""
from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from services.errors import (Cancelled, EngineError, HandoffFailed, HandoffTimedOut, InvalidRequest, Overloaded,
                             PeerMismatch, PeerUnavailable, PromptTooLong, ShuttingDown)
from services.kv.arena import ArenaFull
from services.kv.header import HeaderMismatch

log = logging.getLogger(__name__)

Code = grpc.StatusCode

# first match wins: a subclass comes before its base
STATUS_OF: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (PromptTooLong, Code.OUT_OF_RANGE),
    (InvalidRequest, Code.INVALID_ARGUMENT),
    (Overloaded, Code.RESOURCE_EXHAUSTED),  # QueueFull
    (ArenaFull, Code.RESOURCE_EXHAUSTED),  # no KV slot within the bounded wait
    (HeaderMismatch, Code.FAILED_PRECONDITION),  # the KV that arrived is not what the request expects
    (PeerMismatch, Code.FAILED_PRECONDITION),
    (PeerUnavailable, Code.UNAVAILABLE),
    (ShuttingDown, Code.UNAVAILABLE),  # the gateway retries on the other engine
    (HandoffTimedOut, Code.DEADLINE_EXCEEDED),
    (Cancelled, Code.CANCELLED),
    # HandoffFailed, EngineStepFailed and anything else: INTERNAL, with `internal_message`
)


def internal_message(who: str, request_id: str) -> str:
    return f"internal error in {who} (request {request_id}); see its log"


def status_of(exc: Exception, who: str, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a failed request ends with; logs the details of an internal failure."""
    if not isinstance(exc, HandoffFailed):
        for kind, code in STATUS_OF:
            if isinstance(exc, kind):
                return code, str(exc)
    log.error("request %s failed", request_id, exc_info=exc)
    return Code.INTERNAL, internal_message(who, request_id)


def abort(context: grpc.ServicerContext, exc: Exception, who: str, request_id: str) -> NoReturn:
    context.abort(*status_of(exc, who, request_id))


# a peer engine's status → the error this engine fails with; any code not here: PeerUnavailable
_FROM_PEER: dict[grpc.StatusCode, type[EngineError]] = {
    Code.RESOURCE_EXHAUSTED: Overloaded,
    Code.INVALID_ARGUMENT: InvalidRequest,
    Code.OUT_OF_RANGE: PromptTooLong,  # e.g. its KV can never fit the peer's hand-off memory
    Code.DEADLINE_EXCEEDED: HandoffTimedOut,
    Code.INTERNAL: HandoffFailed,  # the peer failed: a failure here too, never "unavailable"
    Code.UNKNOWN: HandoffFailed,
}


def error_from_peer(peer: str, exc: grpc.RpcError) -> EngineError:
    code = exc.code()
    return _FROM_PEER.get(code, PeerUnavailable)(f"{peer}: {exc.details() or code.name}")
