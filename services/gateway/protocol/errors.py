"""Errors at the edge, in OpenAI's JSON shape with exact status codes.

`{"error": {"message", "type", "param", "code"}}` (openai_format.ErrorBody), for every error a
client sees: raised before a response starts, or sent as the last event of a stream. FastAPI's
422 validation bodies become 400s naming the parameter (`param`); unknown routes and methods
become 404/405 in the same shape; an unexpected exception is a 500 that names no internals.

An engine's gRPC status becomes an HTTP status in one table, `ENGINE_FAILURES`. The client gets
a fixed message per status; the engine's own text (exception messages, shared-memory names,
offsets) goes to the gateway's log with the request id. Only for 400s is the engine's message
kept: it is about the client's own input.

Every 503 the app answers (an engine down, no mode left, the gateway draining) carries
`Retry-After`: the condition is temporary, and clients that honour it back off instead of
hammering a stack that is restarting.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.protocol.openai_format import ErrorBody, ErrorDetail

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # an engine restarting, or a drained gateway replaced, is seconds away

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 502: "server_error", 503: "service_unavailable_error",
          504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> ErrorBody:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorBody:
    return ErrorBody(error=ErrorDetail(message=message, type=_TYPES.get(status, "api_error"), param=param, code=code))


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(error_body(status, message, param, code).model_dump(), status_code=status, headers=headers)


# ---- engine failures ----------------------------------------------------------------------
@dataclass(frozen=True)
class EngineFailure:
    status: int
    code: str
    message: str | None  # None: pass the engine's message on (400s: it is about the client's input)


_ENGINE_FAILED = EngineFailure(500, "engine_error", "the engine failed while serving the request")

ENGINE_FAILURES: dict[grpc.StatusCode, EngineFailure] = {
    grpc.StatusCode.INVALID_ARGUMENT: EngineFailure(400, "invalid_value", None),
    grpc.StatusCode.OUT_OF_RANGE: EngineFailure(400, "context_length_exceeded", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: EngineFailure(429, "engine_overloaded",
                                                      "the engine is at capacity; retry later"),
    grpc.StatusCode.INTERNAL: _ENGINE_FAILED,
    grpc.StatusCode.UNKNOWN: _ENGINE_FAILED,  # what grpc answers for an exception the engine did not catch
    grpc.StatusCode.FAILED_PRECONDITION: EngineFailure(502, "engine_error",
                                                       "the engines could not agree on the request's KV hand-off"),
    grpc.StatusCode.UNAVAILABLE: EngineFailure(503, "engine_unavailable",
                                               "an engine this request needs is unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: EngineFailure(504, "timeout", "the request did not finish within its timeout"),
}
_UNEXPECTED = EngineFailure(502, "engine_error", "the engine ended the request with an unexpected error")


def engine_error(exc: grpc.aio.AioRpcError, mode: str, request_id: str) -> APIError:
    """The client's error for an engine call that failed; the details go to the log, not the client."""
    failure = ENGINE_FAILURES.get(exc.code(), _UNEXPECTED)
    level = logging.INFO if failure.status < 500 else logging.WARNING
    log.log(level, "request %s (%s mode): the engine answered %s: %s", request_id, mode, exc.code().name,
            exc.details())
    return APIError(failure.status, failure.message or exc.details() or exc.code().name.lower(), code=failure.code)


# ---- invalid requests ---------------------------------------------------------------------
_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def validation_error(errors: list[dict]) -> JSONResponse:
    """The 400 for pydantic's errors about a body: the most specific one, `param` its field's path.

    For a field that takes one of several types (`prompt`: text or token ids) pydantic reports an
    error per type, each under a location that names the type; the deepest location is the one
    about what the client meant (a bad token id in a list, not "a list is not a string"), and the
    type names are left out of `param`.
    """
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(400, "the request body is not valid JSON", code="invalid_json")
    located = [(_param_path(e.get("loc", ())), e) for e in errors] or [([], {})]
    path, first = max(located, key=lambda pe: len(pe[0]))  # max keeps the first of equals
    param = ".".join(path) or None
    code = "unsupported_parameter" if first.get("type") == "unsupported_parameter" else "invalid_value"
    msg = first.get("msg", "invalid request")
    return error_response(400, f"{param + ': ' if param else ''}{msg}", param, code)


def _param_path(loc) -> list[str]:
    """("body", "messages", 0, "content", "list[TextPart]", 0, "type") → ["messages", "0", "content", "0", "type"]"""
    path = []
    # a body field, or a path or query parameter (the admin routes' pool): its name without where it was
    for part in loc[1:] if loc and loc[0] in ("body", "path", "query") else loc:
        if isinstance(part, int):
            path.append(str(part))
        elif _FIELD.fullmatch(part) and part not in _TYPE_NAMES:
            path.append(part)  # a field name; union members' type names (list[int], function-after[...]) are not
    return path


# ---- the app's handlers -------------------------------------------------------------------
def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return validation_error(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        messages = {404: "no such route", 405: "method not allowed for this route"}
        return error_response(exc.status_code, messages.get(exc.status_code, str(exc.detail)),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unexpected error")
        return error_response(500, "internal error in the gateway; see its log", code="internal_error")
