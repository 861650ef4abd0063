"""From a routed request to an open engine call; retry and fallback are decided here and nowhere else.

* Route (`Dispatcher.route`): the candidates are the modes whose engines are all up and whose
  context windows hold prompt + max_tokens. A forced mode must be a candidate, or the request is
  refused (503 when an engine it needs is down, 400 when it does not fit). Otherwise the router
  picks among the candidates. The decision's reason is "forced", "auto" when every mode was a
  candidate on the first attempt, and "fallback" otherwise (an engine down, a window too small,
  or a retry).
* Retry (`Dispatcher.open`): a call that fails with a status in `RETRY_ON` before its first
  message, for a request whose mode was not forced, gets its mode's engines health-checked and is
  routed again among the other modes (both engines can answer their health check while the link
  between them is still down, as just after a start), up to `MAX_ATTEMPTS` calls in all. Any other failure is final, and so is one after
  the first message: its tokens may already be on their way to the client.
* Failures become `APIError`s through errors.ENGINE_FAILURES, here (before the first message) and
  in `EngineStream.read` (after it), so the serving loop never sees gRPC.

Engine calls are server-streaming `Generate` RPCs on the engine that serves the mode
(services/modes.py: the decoding one; in hybrid mode it pulls the KV from the prefilling one).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import grpc

from services.gateway import metrics as m
from services.gateway.errors import APIError, engine_error
from services.gateway.router import Decision, Router
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.modes import AUTO, ENGINE_NAMES, MODES
from services.rpc.hybridserve.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

RETRY_ON = frozenset({grpc.StatusCode.UNAVAILABLE})  # the engine may be gone: the health check tells
MAX_ATTEMPTS = 2


@dataclass(frozen=True)
class EngineRequest:
    """What a request asks of the engines, whichever mode serves it."""

    request_id: str  # also the response's id: it ties the client's answer to the logs
    prompt_ids: list[int]
    max_tokens: int
    sampling: pb.SamplingParams
    forced: str | None  # a mode the client named, or None for the router's choice
    timeout_s: float

    @classmethod
    def of(cls, body: CompletionRequest | ChatCompletionRequest, request_id: str, prompt_ids: list[int],
           max_tokens: int, max_timeout_s: float) -> "EngineRequest":
        """From a validated completion or chat body; its own `timeout` may only shorten the gateway's."""
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                     top_k=body.top_k, ignore_eos=body.ignore_eos,
                                     **({"seed": body.seed} if body.seed is not None else {}))
        return cls(request_id, prompt_ids, max_tokens, sampling, None if body.mode == AUTO else body.mode,
                   min(body.timeout or max_timeout_s, max_timeout_s))


class EngineStream:
    """A Generate call whose first message has arrived.

    `read()` gives the next message; a failure or an end before the last message raises APIError.
    `cancel()` ends the call, and the engine frees the request's KV and arena slot.
    """

    def __init__(self, call, decision: Decision, first: pb.GenerateResponse, request_id: str):
        self._call, self.decision, self.first, self.request_id = call, decision, first, request_id

    async def read(self) -> pb.GenerateResponse:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise engine_error(exc, self.decision.mode, self.request_id) from exc
        if msg is grpc.aio.EOF:
            log.warning("request %s (%s mode): the engine ended the stream early", self.request_id,
                        self.decision.mode)
            raise APIError(502, "the engine ended the stream before the last token", code="engine_error")
        return msg

    def cancel(self) -> None:
        self._call.cancel()


class Engines(Protocol):
    """What the dispatcher needs of engine_client.EngineClients (tests pass a fake)."""

    up: dict[str, bool]  # engine -> up at the last health check

    def context_of(self, engine: str) -> int: ...

    async def check(self, engine: str) -> bool: ...

    def generate(self, engine: str, request: pb.GenerateRequest, timeout: float): ...


class Dispatcher:
    """Routes with `router` among the modes `clients` can serve; opens the call on the right engine."""

    def __init__(self, clients: Engines, router: Router):
        self.clients, self.router = clients, router

    def route(self, n_in: int, max_tokens: int, forced: str | None, attempt: int = 0,
              failed: frozenset[str] = frozenset()) -> Decision:
        """`failed`: modes this request's earlier attempts failed in (never a forced one's)."""
        up = [name for name, mode in MODES.items()
              if all(self.clients.up[e] for e in mode.engines) and name not in failed]
        if forced is not None:
            if forced not in up:
                down = [ENGINE_NAMES[e] for e in MODES[forced].engines if not self.clients.up[e]]
                raise APIError(503, f"mode {forced} needs {', '.join(down)}, which is down", "mode",
                               "engine_unavailable")
            if not self._fits(forced, n_in + max_tokens):
                raise APIError(400, f"prompt ({n_in} tokens) + max_tokens ({max_tokens}) exceeds the context "
                                    f"window of mode {forced}", "max_tokens", "context_length_exceeded")
            return self.router.choose(n_in, max_tokens, forced=forced, available=up)
        if not up:
            raise APIError(503, "no engine is up to serve this request", code="engine_unavailable")
        fitting = [name for name in up if self._fits(name, n_in + max_tokens)]
        if not fitting:
            window = max(self._window(name) for name in up)
            raise APIError(400, f"prompt ({n_in} tokens) + max_tokens ({max_tokens}) exceeds the context window "
                                f"of {window} tokens", "max_tokens", "context_length_exceeded")
        d = self.router.choose(n_in, max_tokens, available=fitting)
        every_mode = attempt == 0 and len(fitting) == len(MODES)
        return Decision(d.mode, "auto" if every_mode else "fallback", d.estimates)

    async def open(self, req: EngineRequest) -> EngineStream:
        """Route and call, retrying as the module docstring says; the call once its first message is in."""
        attempt, failed = 0, frozenset()
        while True:
            d = self.route(len(req.prompt_ids), req.max_tokens, req.forced, attempt, failed)
            mode = MODES[d.mode]
            call = self.clients.generate(mode.served_by, pb.GenerateRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_ids, sampling=req.sampling, mode=mode.proto),
                timeout=req.timeout_s)
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as exc:
                if self._retries(exc, req, attempt):
                    log.info("request %s (%s mode): %s; routing again", req.request_id, d.mode, exc.code().name)
                    for engine in mode.engines:
                        await self.clients.check(engine)  # which one is gone decides the next route
                    attempt, failed = attempt + 1, failed | {d.mode}
                    continue
                err = engine_error(exc, d.mode, req.request_id)
                m.REQUESTS.labels(mode=d.mode, status=str(err.status)).inc()
                raise err from exc
            if first is grpc.aio.EOF:
                log.warning("request %s (%s mode): the engine ended the call without a token", req.request_id, d.mode)
                m.REQUESTS.labels(mode=d.mode, status="502").inc()
                raise APIError(502, "the engine ended the call without a token", code="engine_error")
            m.DECISIONS.labels(mode=d.mode, reason=d.reason).inc()
            return EngineStream(call, d, first, req.request_id)

    @staticmethod
    def _retries(exc: grpc.aio.AioRpcError, req: EngineRequest, attempt: int) -> bool:
        return exc.code() in RETRY_ON and req.forced is None and attempt + 1 < MAX_ATTEMPTS

    def _window(self, mode: str) -> int:
        return min(self.clients.context_of(e) for e in MODES[mode].engines)

    def _fits(self, mode: str, n_total: int) -> bool:
        return n_total <= self._window(mode)
