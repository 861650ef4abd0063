"""The typed failures every layer raises: a request that is wrong, no room now, a peer or a hand-off
that failed, an engine going down.

A leaf: kv/ (the hand-off's transports) and engine/ (the runtime, both engines) import these, and
neither imports the other for them. Each carries a message written by us, safe to show a client;
anything else that escapes is an internal failure whose text stays in the log. The engines' status
table (services/engine/status.py) maps each to a gRPC status, and the gateway's (gateway/protocol/
errors.py) each status to an HTTP one.
"""
from __future__ import annotations


class EngineError(Exception):
    """A request failed for a reason its caller can act on; the message is safe to show."""


class InvalidRequest(EngineError, ValueError):
    """The request itself is wrong (bad ids, bad sampling parameters, a mode not served here)."""


class PromptTooLong(InvalidRequest):
    """The prompt does not leave room for one generated token in the context window."""


class HandoffTooLarge(PromptTooLong):
    """The prompt's KV is larger than all the memory a hybrid hand-off may hold: it could never be
    handed over (a retry would not help; the single-device modes may still serve it)."""


class Overloaded(EngineError):
    """No room now (queue full, no slot, no sequence): back-pressure; a retry later may fit."""


class QueueFull(Overloaded):
    """More requests wait than the queue holds."""


class Cancelled(EngineError):
    """The request was cancelled (its client went away) before it finished."""


class PeerUnavailable(EngineError):
    """The other engine (prefill_gpu, for hybrid mode) cannot be reached."""


class PeerMismatch(EngineError):
    """The other engine serves another model, or its KV arena is not on this host: a deployment fault."""


class HandoffTimedOut(EngineError):
    """The KV hand-off did not finish within its deadline."""


class HandoffFailed(EngineError):
    """The other engine failed the KV hand-off. Internal: its details stay in the logs."""


class EngineStepFailed(EngineError):
    """The engine failed a batched step this request was in. Internal: its details stay in the log."""


class ShuttingDown(EngineError):
    """The engine's loop has stopped: the service is going down; another engine may serve it."""
