"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Tokenizing and detokenizing happen here; the engines see token ids only. Each
request is routed (router.py), sent to the engine that serves its mode, and its
tokens are streamed back as text. A client that disconnects cancels the engine
call, which frees the request's KV and arena slot upstream.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.model.checkpoint import locate
from services.gateway import metrics as m
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.engine_client import EngineClients
from services.gateway.errors import APIError, error_response, install
from services.gateway.router import Decision, Router, samples_from_timings
from services.modes import ENGINE_NAMES, MODE_NAMES, MODES
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.settings import GatewaySettings
from services.gateway.stops import StopMatcher
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.model.tokenizer import chat_prompt_ids, load_tokenizer

log = logging.getLogger(__name__)

GRPC_TO_HTTP = {grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "engine_overloaded"),
                grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_value"),
                grpc.StatusCode.OUT_OF_RANGE: (400, "context_length_exceeded"),
                grpc.StatusCode.UNAVAILABLE: (503, "engine_unavailable"),
                grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout")}


@dataclass
class State:
    settings: GatewaySettings
    tokenizer: object
    clients: EngineClients
    router: Router
    model_name: str
    file_samples: list[dict] = field(default_factory=list)


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
        st = State(settings, tokenizer, clients, Router(file_samples), settings.served_model_name or ckpt.model_id,
                   file_samples)
        app.state.hs = st
        task = asyncio.create_task(_watch_engines(st))
        try:
            yield
        finally:
            task.cancel()
            await clients.close()

    app = FastAPI(title="hybridserve gateway", lifespan=lifespan)
    install(app)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return error_response(413, f"request body over {settings.max_body_bytes} bytes", code="body_too_large")
        return await call_next(request)

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
        return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": 0,
                                            "owned_by": "hybridserve"}]}

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
        return await _serve(st, request, body, prompt_ids, body.max_tokens or 16, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request, st: State = Depends(state)):
        _check_model(st, body.model)
        messages = [{"role": "system" if msg.role == "developer" else msg.role, "content": msg.text()}
                    for msg in body.messages]
        prompt_ids = chat_prompt_ids(st.tokenizer, messages)
        max_tokens = body.max_completion_tokens or body.max_tokens or st.settings.chat_default_max_tokens
        return await _serve(st, request, body, prompt_ids, max_tokens, chat=True)

    return app


def _check_model(st: State, model: str) -> None:
    if model != st.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {st.model_name!r}", "model",
                       "model_not_found")


async def _watch_engines(st: State) -> None:
    """Health every interval; each engine's Profile feeds the router once it is up."""
    while True:
        await st.clients.check_all()
        for engine, up in st.clients.up.items():
            if up and _wants_profile(st.clients, engine):
                if await st.clients.fetch_profile(engine) is not None:
                    samples = st.file_samples + [s for p in st.clients.profiles.values() for s in p]
                    st.router.set_base_samples(samples)
                    info = st.clients.info.get(engine)
                    st.router.concurrency[engine] = max(1, info.max_concurrency if info else 1)
        await asyncio.sleep(st.settings.health_interval_s)


def _wants_profile(clients: EngineClients, engine: str) -> bool:
    """No profile yet, or decode_fpga's lacks the hand-off samples it can only measure with prefill_gpu up."""
    have = clients.profiles.get(engine)
    if have is None:
        return True
    return engine == "fpga" and clients.up["gpu"] and not any(s["stage"] == "handoff" for s in have)


# ---- routing -------------------------------------------------------------------------
def _fits(st: State, mode: str, n_total: int) -> bool:
    return all(n_total <= st.clients.context_of(e) for e in MODES[mode].engines)


def _decide(st: State, n_in: int, max_tokens: int, forced: str | None) -> Decision:
    clients, total = st.clients, n_in + max_tokens
    up = [mode for mode in MODE_NAMES if all(clients.up[e] for e in MODES[mode].engines)]
    if forced is not None:
        if forced not in up:
            down = [ENGINE_NAMES[e] for e in MODES[forced].engines if not clients.up[e]]
            raise APIError(503, f"mode {forced} needs {', '.join(down)}, which is down", "mode", "engine_unavailable")
        if not _fits(st, forced, total):
            raise APIError(400, f"prompt ({n_in} tokens) + max_tokens ({max_tokens}) exceeds the context window of "
                                f"mode {forced}", "max_tokens", "context_length_exceeded")
        return st.router.choose(n_in, max_tokens, forced=forced, available=up)
    if not up:
        raise APIError(503, "no engine is up to serve this request", code="engine_unavailable")
    fitting = [mode for mode in up if _fits(st, mode, total)]
    if not fitting:
        window = max(min(clients.context_of(e) for e in MODES[mode].engines) for mode in up)
        raise APIError(400, f"prompt ({n_in} tokens) + max_tokens ({max_tokens}) exceeds the context window of "
                            f"{window} tokens", "max_tokens", "context_length_exceeded")
    d = st.router.choose(n_in, max_tokens, available=fitting)
    if len(up) < len(MODE_NAMES) and d.reason == "auto":
        d = Decision(d.mode, "fallback", d.estimates)
    return d


async def _start(st: State, body, prompt_ids: list[int], max_tokens: int):
    """Route and open the engine call; return (decision, call, first message). Falls back once."""
    forced = None if body.mode == "auto" else body.mode
    timeout = min(body.timeout or st.settings.request_timeout_s, st.settings.request_timeout_s)
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                 top_k=body.top_k, ignore_eos=body.ignore_eos, **(
                                     {"seed": body.seed} if body.seed is not None else {}))
    for attempt in range(2):
        d = _decide(st, len(prompt_ids), max_tokens, forced)
        if attempt == 1 and d.reason == "auto":
            d = Decision(d.mode, "fallback", d.estimates)
        call = st.clients.stubs[MODES[d.mode].served_by].Generate(
            pb.GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt_ids, sampling=sampling,
                               mode=MODES[d.mode].proto), timeout=timeout)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and forced is None and attempt == 0:
                for e in MODES[d.mode].engines:
                    await st.clients.check(e)  # find out which one is gone, then route again
                continue
            err = _api_error(exc, d.mode)
            m.REQUESTS.labels(mode=d.mode, status=str(err.status)).inc()
            raise err from exc
        if first is grpc.aio.EOF:
            raise APIError(502, "the engine ended the call without a token", code="engine_error")
        m.DECISIONS.labels(mode=d.mode, reason=d.reason).inc()
        return d, call, first
    raise APIError(503, "no engine is able to serve this request", code="engine_unavailable")


def _api_error(exc: grpc.aio.AioRpcError, mode: str) -> APIError:
    status, code = GRPC_TO_HTTP.get(exc.code(), (502, "engine_error"))
    return APIError(status, f"{mode} engine: {exc.details() or exc.code().name}", code=code)


# ---- serving -------------------------------------------------------------------------
@dataclass
class _Run:
    """One request's progress, shared by the streaming and the non-streaming paths."""

    st: State
    decision: Decision
    n_in: int
    started: float
    detok: IncrementalDetokenizer
    stops: StopMatcher
    n_out: int = 0
    finish_reason: str | None = None
    timings: pb.Timings | None = None
    last_token_at: float | None = None

    def take(self, msg: pb.GenerateResponse) -> str:
        """Account for one engine message; the text it adds (after stop strings)."""
        now = time.perf_counter()
        mode = self.decision.mode
        for _ in msg.token_ids:
            if self.last_token_at is None:
                m.TTFT.labels(mode=mode).observe(now - self.started)
            else:
                m.ITL.labels(mode=mode).observe(now - self.last_token_at)
            self.last_token_at = now
        text = ""
        for t in msg.token_ids:
            self.n_out += 1
            text += self.stops.feed(self.detok.add(t))
        if msg.finish_reason:
            self.finish_reason, self.timings = msg.finish_reason, msg.timings
            text += self.stops.feed(self.detok.flush()) + self.stops.flush()
        if self.stops.stopped:
            self.finish_reason = "stop"
        return text

    def finish(self, status: str = "200") -> None:
        mode, e2e = self.decision.mode, time.perf_counter() - self.started
        m.REQUESTS.labels(mode=mode, status=status).inc()
        m.PROMPT_TOKENS.inc(self.n_in)
        m.GENERATION_TOKENS.inc(self.n_out)
        self.st.router.finished(mode, e2e)
        if status != "200":
            return
        m.E2E.labels(mode=mode).observe(e2e)
        predicted = self.decision.estimates.get(mode)
        if predicted is not None and e2e > 0:
            m.ESTIMATE_ERROR.labels(mode=mode).observe(abs(predicted - e2e) / e2e)
        if self.timings is not None and self.finish_reason and not self.stops.stopped:
            self.st.router.observe(samples_from_timings(mode, self.n_in, self.timing_dict()))

    def timing_dict(self) -> dict:
        t = self.timings or pb.Timings()
        return {"queue_s": t.queue_s, "prefill_s": t.prefill_s, "handoff_total_s": t.handoff_total_s,
                "handoff_exposed_s": t.handoff_exposed_s, "decode_s": t.decode_s,
                "decode_tokens": max(0, t.generated_tokens - 1), "handoff_bytes": t.handoff_bytes,
                "e2e_s": time.perf_counter() - self.started}

    def extension(self) -> dict:
        d = self.decision
        return {"mode": d.mode, "reason": d.reason, "estimates": d.estimates, "timings": self.timing_dict()}

    def usage(self) -> dict:
        return {"prompt_tokens": self.n_in, "completion_tokens": self.n_out, "total_tokens": self.n_in + self.n_out}


async def _serve(st: State, request: Request, body, prompt_ids: list[int], max_tokens: int, chat: bool):
    started = time.perf_counter()
    decision, call, first = await _start(st, body, prompt_ids, max_tokens)
    st.router.started(decision.mode)
    run = _Run(st, decision, len(prompt_ids), started, IncrementalDetokenizer(st.tokenizer), StopMatcher(body.stops))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    headers = {"x-hybridserve-mode": decision.mode}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(run, call, first, rid, st.model_name, chat, include_usage),
                                 media_type="text/event-stream", headers=headers)
    text, msg, status = "", first, "499"
    try:
        while True:
            text += run.take(msg)
            if run.finish_reason:
                break
            if await request.is_disconnected():
                return Response(status_code=499)
            msg = await call.read()
            if msg is grpc.aio.EOF:
                raise APIError(502, "the engine ended the stream without a finish reason", code="engine_error")
        status = "200"
    except grpc.aio.AioRpcError as exc:
        err = _api_error(exc, decision.mode)
        status = str(err.status)
        raise err from exc
    except APIError as err:
        status = str(err.status)
        raise
    finally:
        call.cancel()
        run.finish(status)
    created = int(time.time())
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": run.finish_reason,
                  "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": run.finish_reason, "logprobs": None}
        obj = "text_completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": st.model_name, "choices": [choice],
                         "usage": run.usage(), "hybridserve": run.extension()}, headers=headers)


async def _sse(run: _Run, call, first, rid: str, model: str, chat: bool, include_usage: bool):
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, **extra) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                      "choices": [choice], **extra}) + "\n\n"

    status = "499"  # until the stream completes, a stop means the client went away
    try:
        if chat:
            yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                 "logprobs": None}]}) + "\n\n"
        msg = first
        while True:
            text = run.take(msg)
            if run.finish_reason:
                if text:
                    yield chunk(text, None)
                yield chunk(None if chat else "", run.finish_reason, hybridserve=run.extension())
                break
            if text:
                yield chunk(text, None)
            msg = await call.read()
            if msg is grpc.aio.EOF:
                raise APIError(502, "the engine ended the stream early", code="engine_error")
        if include_usage:
            yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                         "usage": run.usage()}) + "\n\n"
        yield "data: [DONE]\n\n"
        status = "200"
    except grpc.aio.AioRpcError as exc:
        code = GRPC_TO_HTTP.get(exc.code(), (502, "engine_error"))
        status = str(code[0])
        yield "data: " + json.dumps({"error": {"message": f"engine: {exc.details()}", "type": "api_error",
                                               "param": None, "code": code[1]}}) + "\n\n"
    finally:
        call.cancel()  # a disconnect lands here too: the engine frees the request's KV and slot
        run.finish(status)
