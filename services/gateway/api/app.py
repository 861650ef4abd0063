"""The OpenAI-compatible HTTP API: the app factory and its routes.

    /v1/completions, /v1/chat/completions   tokenize, then dispatch/dispatcher.py (route + engine call) and
                                            serving.py (engine tokens → text → JSON or a stream)
    /v1/models, /health, /metrics, /openapi.json, /docs, /redoc

Tokenizing happens here, on one worker thread (the tokenizer is not safe to share between
threads, and a long prompt must not stall the event loop); the engines see token ids only.
Who may call which route is auth.py; the body limit, outside every route, body_limit.py; the
drain on shutdown, outside that, drain.py; what
the OpenAPI document declares, openapi.py. The shapes of every answer are in openai_format.py,
the errors and their statuses in errors.py, and the watch over the engines
(health, Profile → router) in engine_watch.py; the engine pairs (one unless the settings name
more, or a DNS name finds them) in pairs.py.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.api import openapi
from services.gateway.api.auth import ApiKey, warn_if_exposed
from services.gateway.api.body_limit import BodyLimit
from services.gateway.api.drain import Drain, DrainGate
from services.gateway.api.pool_admin import RESPONSES as POOL_ADMIN_RESPONSES
from services.gateway.api.pool_admin import pool_routes
from services.gateway.api.readiness import Readiness
from services.gateway.api.router_debug import debug_routes
from services.gateway.api.tokenize_routes import chat_ids, tokenize_routes
from services.gateway.dispatch.dispatcher import Dispatcher
from services.gateway.dispatch.prompts import PromptsRun
from services.gateway.dispatch.request import RoutedRequest
from services.gateway.dispatch.serving import Run, sse_events, unary_response
from services.gateway.fleet.engine_client import EngineClients
from services.gateway.fleet.pair_discovery import DnsPairs
from services.gateway.fleet.pairs import Address, Pairs
from services.gateway.fleet.planner import Planner
from services.gateway.fleet.planner import publish as publish_planner
from services.gateway.output.choice import Choice, Echo
from services.gateway.output.detokenizer import IncrementalDetokenizer
from services.gateway.output.fence import FenceStripper
from services.gateway.output.logprobs_format import LogprobsWriter, TokenTexts
from services.gateway.output.stops import StopMatcher
from services.gateway.protocol.errors import APIError, install
from services.gateway.protocol.openai_format import ChatCompletion, ChunkWriter, Completion, Health, ModelCard, ModelList
from services.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.protocol.structured import GrammarError
from services.gateway.protocol.tools import call_grammar, template_takes_tools
from services.gateway.routing.engine_watch import watch_engines
from services.gateway.routing.router import Router
from services.gateway.settings import GatewaySettings
from services.model.checkpoint import locate
from services.model.tokenizer import ids_text, load_tokenizer, text_ids

log = logging.getLogger(__name__)


@dataclass
class State:
    settings: GatewaySettings
    tokenizer: object
    pairs: Pairs  # the engine pairs (one unless the settings name more)
    router: Router
    dispatcher: Dispatcher
    model_name: str
    tokenize_pool: ThreadPoolExecutor  # one thread: every tokenizer call runs on it, in turn
    token_texts: TokenTexts  # each token's text and bytes, for logprobs
    connect: Callable[[Address], EngineClients] | None = None  # a pair's clients, for pools changed at run time

    async def tokenize(self, fn, *args) -> list[int]:
        """`fn(tokenizer, *args)` on the tokenizer's thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, self.tokenizer, *args)


# ---- dependencies ---------------------------------------------------------------------
def state(request: Request) -> State:
    return request.app.state.hs


# ---- the app --------------------------------------------------------------------------
def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    warn_if_exposed(settings.host, settings.api_key)
    api_key = Depends(ApiKey(settings.api_key))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ckpt = locate(settings.model)
        tokenizer = await asyncio.to_thread(load_tokenizer, ckpt)
        token = settings.engine_token.get_secret_value() if settings.engine_token else None
        addresses = [] if settings.pairs_dns else settings.pair_addresses()
        connect = lambda address: EngineClients(  # noqa: E731
            address[0], address[1], token, "" if len(addresses) == 1 else f"pair {address[0]}|{address[1]}: ")
        pairs = Pairs({i: connect(a) for i, a in enumerate(addresses)}, dict(enumerate(addresses)),
                      settings.prefix_policy(), pools=settings.pools)
        discover = None
        if settings.pairs_dns:
            ports = [int(a.rpartition(":")[2]) for a in (settings.prefill_address, settings.decode_address)]
            discover = DnsPairs(pairs, settings.pairs_dns, *ports, connect, settings.pairs_dns_refresh_s).refresh
        file_samples = json.loads(open(settings.calibration_file).read()) if settings.calibration_file else []
        router = Router(file_samples, explore_share=settings.router_explore_share,
                        first_token_waits=settings.router_first_token_waits, crowding=settings.router_crowding,
                        prefill_ahead=settings.router_prefill_ahead)
        pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        dispatcher = Dispatcher(pairs, router)
        dispatcher.planner = planner = Planner(settings.planner_targets())
        app.state.hs = State(settings, tokenizer, pairs, router, dispatcher,
                             settings.served_model_name or ckpt.model_id, pool, TokenTexts(tokenizer), connect)
        publish_planner(planner, router, pairs)  # hybridserve_planner_* on /metrics
        watch = asyncio.create_task(watch_engines(pairs, router, file_samples, settings.health_interval_s,
                                                  settings.engines_share_cpu, discover))
        try:
            yield
        finally:
            watch.cancel()
            await asyncio.gather(*(c.close() for c in pairs.members.values()))
            pool.shutdown(wait=False, cancel_futures=True)

    # the documents are routes of ours, so that they need the key like the API
    app = FastAPI(title="hybridserve gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install(app)
    openapi.install(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, read_timeout_s=settings.body_read_timeout_s)
    app.state.drain = Drain(settings.drain_grace_s)  # begun by server.DrainingServer on SIGTERM
    app.add_middleware(DrainGate, drain=app.state.drain)  # added last: outermost

    app.include_router(debug_routes(lambda: app.state.hs.router, lambda: app.state.hs.pairs,
                                    lambda: app.state.hs.dispatcher.planner), dependencies=[api_key],
                       responses=openapi.errors(*openapi.EDGE))
    if settings.pool_admin:  # `hybridserve up --autoscale` adds and removes engines (pool_admin.py)
        app.include_router(pool_routes(lambda: app.state.hs.pairs, lambda: app.state.hs.connect),
                           dependencies=[api_key], responses=POOL_ADMIN_RESPONSES)

    readiness = app.state.readiness = Readiness()

    @app.get("/health", response_model=Health,
             responses={503: {"model": Health, "description": (
                 "not ready: no pair has both engines up, the router is calibrating for the first time, or the "
                 "gateway is draining (`waiting_for` says which)")}, **openapi.errors(408, 413)})
    @app.get("/readyz", response_model=Health, include_in_schema=False)
    async def health(st: State = Depends(state)):
        up = await st.pairs.check_all()  # pair -> engine -> up
        one_pair = len(up) == 1 and not st.settings.pairs_dns
        body, status = readiness.health(up, st.router.calibrated, app.state.drain.draining, one_pair)
        return Response(body.model_dump_json(), media_type="application/json", status_code=status)

    @app.get("/livez", responses={200: {"description": "the gateway's process answers"}})
    async def livez():
        return JSONResponse({"status": "alive"})

    @app.get("/metrics", dependencies=[] if settings.metrics_open else [api_key], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                              "description": "Prometheus' text format"},
                        **openapi.errors(*openapi.EDGE)})
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", dependencies=[api_key], include_in_schema=False)
    async def openapi_document():
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=[api_key], include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @app.get("/redoc", dependencies=[api_key], include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=app.title)

    app.include_router(tokenize_routes(lambda: app.state.hs, _check_model), dependencies=[api_key])

    @app.get("/v1/models", dependencies=[api_key], response_model=ModelList, responses=openapi.errors(*openapi.EDGE))
    async def models(st: State = Depends(state)):
        return Response(ModelList(data=[ModelCard(id=st.model_name)]).model_dump_json(),
                        media_type="application/json")

    @app.post("/v1/completions", dependencies=[api_key],
              responses={**openapi.stream_or_json(Completion), **openapi.errors(*openapi.GENERATION)})
    async def completions(body: CompletionRequest, request: Request, st: State = Depends(state)):
        _check_model(st, body.model)
        prompts, echoes, vocab = [], [], len(st.tokenizer)
        for prompt in body.prompts:
            if isinstance(prompt, str):
                prompt_ids = await st.tokenize(text_ids, prompt)
            else:
                prompt_ids = list(prompt)
                if max(prompt_ids) >= vocab:
                    raise APIError(400, f"token ids must be below the vocabulary size {vocab}", "prompt",
                                   "invalid_value")
            prompts.append(prompt_ids)
            if body.echo:  # the prompt as text: the client's own, or its token ids decoded
                echoes.append(prompt if isinstance(prompt, str) else await st.tokenize(ids_text, prompt_ids))
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return await _respond(st, request, body, prompts, max_tokens, chat=False, echoes=echoes or None)

    @app.post("/v1/chat/completions", dependencies=[api_key],
              responses={**openapi.stream_or_json(ChatCompletion), **openapi.errors(*openapi.GENERATION)})
    async def chat_completions(body: ChatCompletionRequest, request: Request, st: State = Depends(state)):
        _check_model(st, body.model)
        tools = _offered_tools(st, body)
        prompt_ids = await chat_ids(st, body.messages, tools, body.add_generation_prompt, body.continue_final_message)
        max_tokens = body.max_completion_tokens or body.max_tokens or st.settings.chat_default_max_tokens
        return await _respond(st, request, body, [prompt_ids], max_tokens, chat=True,
                              tool_names={t["function"]["name"] for t in tools} if tools else None)

    return app


def _offered_tools(st: State, body: ChatCompletionRequest) -> list[dict] | None:
    """The tools the prompt shows the model (services/gateway/protocol/tools.py), checked against its chat template;
    with tool_choice required or named, the call's grammar goes to the engines."""
    tools = body.tools_offered
    if tools is None:
        return None
    if not template_takes_tools(st.tokenizer):
        raise APIError(400, "this model's chat template does not define tools, so they cannot be shown to it; "
                       "send no tools (or tool_choice none)", "tools", "unsupported_parameter")
    if body.forced_function is not None:
        if body.response_format is not None and body.response_format.compiled:
            raise APIError(400, "response_format cannot be combined with tool_choice required or a named function",
                           "response_format", "invalid_value")
        try:
            body._tool_grammar = call_grammar([t["function"] for t in tools], body.forced_function or None)
        except GrammarError as exc:
            raise APIError(400, f"a tool's parameters cannot be compiled: {exc}", "tools", "invalid_value") from None
    return tools


def _check_model(st: State, model: str) -> None:
    if model != st.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {st.model_name!r}", "model",
                       "model_not_found")


async def _respond(st: State, request: Request, body: CompletionRequest | ChatCompletionRequest,
                   prompts: list[list[int]], max_tokens: int, chat: bool, echoes: list[str] | None = None,
                   tool_names: set[str] | None = None) -> Response:
    """Open the engine calls (routing, retry, fallback), then answer in one piece or as a stream.

    `prompts`: token ids, one list per prompt (several: completions only, prompts.py); `echoes`: each
    prompt's text, returned before its completion. max_tokens 0 (echo only) still asks the engines for
    one token, which is not shown: an engine call ends with a token. `tool_names`: the tools offered
    (chat); the output's calls of them become `tool_calls` (tools.py)."""
    started = time.perf_counter()
    vocab = len(st.tokenizer)
    beyond = sorted(t for t in body.bias_pairs() if t >= vocab)
    if beyond:
        raise APIError(400, f"logit_bias names token ids past the vocabulary ({vocab}): {beyond[:5]}", "logit_bias",
                       "invalid_value")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    asked = body.top_logprobs_asked is not None
    per_prompt = body.choices_generated
    fenced = body.fenced_grammar(st.settings.json_fence) != body.grammar  # the fence is taken off the text
    choices = [[Choice(p * per_prompt + i, IncrementalDetokenizer(st.tokenizer),
                       StopMatcher(body.stops, body.include_stop_str_in_output),
                       LogprobsWriter(st.token_texts, chat) if asked else None,
                       Echo(echoes[p], ids) if echoes else None, show_output=max_tokens > 0,
                       fence=FenceStripper() if fenced else None)
                for i in range(per_prompt)] for p, ids in enumerate(prompts)]
    routed = RoutedRequest.of(body, rid, prompts[0], max(1, max_tokens), st.settings.request_timeout_s,
                              allow_fence=st.settings.json_fence)
    if len(prompts) == 1:
        stream = await st.dispatcher.open(routed)
        run = Run(st.router, stream.decision, len(prompts[0]), started, choices[0])
        run.tool_names = tool_names
        headers = {"x-hybridserve-mode": stream.decision.mode, "x-hybridserve-pair": str(stream.decision.pair)}
    else:
        for ids in prompts:  # a prompt too long for every mode is the request's 400, before any call
            st.dispatcher.check_window(len(ids), max(1, max_tokens), routed.forced)
        run = stream = PromptsRun(st.dispatcher, st.router, routed, prompts, choices,
                                  st.settings.prompts_in_flight, started)
        await run.open()
        headers = {"x-hybridserve-mode": run.modes, "x-hybridserve-pair": run.pairs}
    if body.ignored_fields:
        headers["x-hybridserve-ignored-fields"] = said = body.ignored_header()
        log.info("request %s: fields not read by this server, ignored: %s", rid, said)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = ChunkWriter(rid, st.model_name, int(time.time()), chat)
        return StreamingResponse(sse_events(run, stream, chunks, include_usage), media_type="text/event-stream",
                                 headers=headers)
    return await unary_response(run, stream, request, st.model_name, chat, headers, body.n)
