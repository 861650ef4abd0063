"""The OpenAI-compatible HTTP API: the app factory and its routes.

    /v1/completions, /v1/chat/completions   tokenize, then dispatch.py (route + engine call) and
                                            serving.py (engine tokens → text → JSON or a stream)
    /v1/models, /health, /metrics

Tokenizing happens here; the engines see token ids only. The shapes of every answer are in
openai_format.py, the errors and their statuses in errors.py, and the watch over the engines
(health, Profile → router) in engine_watch.py.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.dispatch import Dispatcher, EngineRequest
from services.gateway.engine_client import EngineClients
from services.gateway.engine_watch import watch_engines
from services.gateway.errors import APIError, error_response, install
from services.gateway.openai_format import ChunkWriter, ModelCard, ModelList
from services.gateway.router_debug import debug_routes
from services.gateway.router import Router
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.serving import Run, sse_events, unary_response
from services.gateway.settings import GatewaySettings
from services.gateway.stops import StopMatcher
from services.model.checkpoint import locate
from services.model.tokenizer import chat_prompt_ids, load_tokenizer
from services.modes import ENGINE_NAMES


@dataclass
class State:
    settings: GatewaySettings
    tokenizer: object
    clients: EngineClients
    router: Router
    dispatcher: Dispatcher
    model_name: str


# ---- dependencies ---------------------------------------------------------------------
def state(request: Request) -> State:
    return request.app.state.hs


def require_api_key(request: Request, st: State = Depends(state)) -> None:
    key = st.settings.api_key
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    if not auth.startswith("Bearer ") or auth[7:] != key.get_secret_value():
        raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`", code="invalid_api_key")


# ---- the app --------------------------------------------------------------------------
def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ckpt = locate(settings.model)
        tokenizer = await asyncio.to_thread(load_tokenizer, ckpt)
        clients = EngineClients(settings.prefill_address, settings.decode_address)
        file_samples = json.loads(open(settings.calibration_file).read()) if settings.calibration_file else []
        router = Router(file_samples, explore_share=settings.router_explore_share)
        app.state.hs = State(settings, tokenizer, clients, router, Dispatcher(clients, router),
                             settings.served_model_name or ckpt.model_id)
        watch = asyncio.create_task(watch_engines(clients, router, file_samples, settings.health_interval_s))
        try:
            yield
        finally:
            watch.cancel()
            await clients.close()

    app = FastAPI(title="hybridserve gateway", lifespan=lifespan)
    install(app)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return error_response(413, f"request body over {settings.max_body_bytes} bytes", code="body_too_large")
        return await call_next(request)

    app.include_router(debug_routes(lambda: app.state.hs.router), dependencies=[Depends(require_api_key)])

    @app.get("/health")
    async def health(st: State = Depends(state)):
        up = await st.clients.check_all()
        body = {"status": "ok" if all(up.values()) else "degraded",
                "engines": {ENGINE_NAMES[e]: "up" if ok else "down" for e, ok in up.items()}}
        return JSONResponse(body, status_code=200 if all(up.values()) else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def models(st: State = Depends(state)):
        return Response(ModelList(data=[ModelCard(id=st.model_name)]).model_dump_json(),
                        media_type="application/json")

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)])
    async def completions(body: CompletionRequest, request: Request, st: State = Depends(state)):
        _check_model(st, body.model)
        if isinstance(body.prompt, str):
            prompt_ids = st.tokenizer(body.prompt).input_ids
        else:
            prompt_ids = list(body.prompt)
            vocab = len(st.tokenizer)
            if max(prompt_ids) >= vocab:
                raise APIError(400, f"token ids must be below the vocabulary size {vocab}", "prompt", "invalid_value")
        return await _respond(st, request, body, prompt_ids, body.max_tokens or 16, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request, st: State = Depends(state)):
        _check_model(st, body.model)
        messages = [{"role": "system" if msg.role == "developer" else msg.role, "content": msg.text()}
                    for msg in body.messages]
        prompt_ids = chat_prompt_ids(st.tokenizer, messages)
        max_tokens = body.max_completion_tokens or body.max_tokens or st.settings.chat_default_max_tokens
        return await _respond(st, request, body, prompt_ids, max_tokens, chat=True)

    return app


def _check_model(st: State, model: str) -> None:
    if model != st.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {st.model_name!r}", "model",
                       "model_not_found")


async def _respond(st: State, request: Request, body: CompletionRequest | ChatCompletionRequest,
                 prompt_ids: list[int], max_tokens: int, chat: bool) -> Response:
    """Open the engine call (routing, retry, fallback), then answer in one piece or as a stream."""
    started = time.perf_counter()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    stream = await st.dispatcher.open(EngineRequest.of(body, rid, prompt_ids, max_tokens,
                                                       st.settings.request_timeout_s))
    run = Run(st.router, stream.decision, len(prompt_ids), started, IncrementalDetokenizer(st.tokenizer),
              StopMatcher(body.stops))
    headers = {"x-hybridserve-mode": stream.decision.mode}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = ChunkWriter(rid, st.model_name, int(time.time()), chat)
        return StreamingResponse(sse_events(run, stream, chunks, include_usage), media_type="text/event-stream",
                                 headers=headers)
    return await unary_response(run, stream, request, st.model_name, chat, headers)
