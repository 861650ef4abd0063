"""The gateway's OpenAPI document: what each route answers, errors included, in OpenAI's shapes.

Every operation declares the error statuses it can answer with the error body's schema
(`ErrorBody`), so a client (or a fuzzer checking responses against the document) knows every
answer it can get. FastAPI's own 422 is left out: validation errors are 400s here (errors.py).
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from services.gateway.protocol.openai_format import ErrorBody

_MEANING = {400: "invalid parameters, malformed JSON, or prompt + max_tokens over the context window",
            401: "missing or wrong API key", 404: "unknown model", 408: "the body did not arrive in time",
            413: "request body too large", 429: "the engines' queues are full",
            500: "an engine or the gateway failed", 502: "an engine ended the request unexpectedly",
            503: "no engine able to serve the request is up", 504: "the request's deadline passed"}

# every route: the API key, then the body's size and deadline (body_limit.py)
EDGE = (401, 408, 413)
GENERATION = (400, 401, 404, 408, 413, 429, 500, 502, 503, 504)


def errors(*statuses: int) -> dict:
    """`responses=` for a route: each status with the error body's schema."""
    return {s: {"model": ErrorBody, "description": _MEANING[s]} for s in statuses}


# One server-sent event of a stream: `data` is a chunk's JSON, an error's JSON, or "[DONE]". (Before
# OpenAPI 3.2's itemSchema, the schema of text/event-stream is read as the schema of each event.)
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}


def stream_or_json(model) -> dict:
    """The 200 of a generation route: the JSON object, or server-sent events when `stream` is true."""
    return {200: {"model": model, "description": "the completion; with `stream`: server-sent events",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


def install(app: FastAPI) -> None:
    """Replace app.openapi with a builder that leaves out FastAPI's 422s (cached, as FastAPI's is)."""

    def document() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in doc.get("paths", {}).values():
                for op in operations.values():
                    op.get("responses", {}).pop("422", None)
            schemas = doc.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = document
