"""From a routed request to an open engine call; retry and fallback are decided here and nowhere else,
and the migration rules are written here (engine_stream.py carries them out: an open call's
messages, and its continuation when its engine is lost, through `Dispatcher.call`).

* Route (`Dispatcher.route`): the candidates are the modes whose engines are all up and whose
  context windows hold prompt + max_tokens. A forced mode must be a candidate, or the request is
  refused (503 when an engine it needs is down, 400 when it does not fit). Otherwise the router
  picks among the candidates. The decision's reason is "forced", "auto" when every mode was a
  candidate on the first attempt, and "fallback" otherwise (an engine down, a window too small,
  or a retry).
* Retry (`Dispatcher.call`): a call that fails with a status in `RETRY_ON` before its first
  message, for a request whose mode was not forced (or, with several pairs, was: then only to the
  same mode on another pair), gets its mode's engines health-checked and is
  routed again among the other modes (both engines can answer their health check while the link
  between them is still down, as just after a start), up to `MAX_ATTEMPTS` calls in all. Any other
  failure before the first message is final. After it, tokens may be on their way to the client:
  the same call cannot be made again, but the rest of the request can (migrate, below).
* Migrate (`EngineStream.read`): a call that fails after its first message, when its engine is
  gone (UNAVAILABLE, or a health check finds an engine of its mode down after any failure that is
  not about the request itself), is re-submitted as prompt + the tokens generated so far, with
  max_tokens less those tokens, to a mode whose engines are up (never one this request already
  failed in; a forced mode too: the client asked for a mode to run in, not to lose the request).
  The reader gets the new call's messages as if nothing happened: no token twice, none missing.
  Greedy output is the same tokens as an uninterrupted run's (every mode gives the same greedy
  tokens). A seeded sampled request is re-submitted with the same seed, and engines key each
  token's randomness by the seed and the token's position (services/engine/sampling.py), so the
  rest are the tokens an uninterrupted run would have given too; the call says how many of its
  prompt's tokens are output already (`prior_output_tokens`), which the penalties and min_tokens
  count as output.
  A request with n > 1 choices migrates the same way, choice by choice: each unfinished choice
  continues in a call of its own (prompt + that choice's tokens, n = 1, drawing that choice's random
  numbers: `first_choice`), and the stream merges those calls' messages under the choices' indices.
  With no mode left, the error is the route's 503.
* Pairs: the gateway may front several (prefill_gpu, decode_fpga) pairs (pairs.py). A mode is a
  candidate when some pair has its engines up; once the router has picked the mode, the call goes
  to the least loaded such pair (pair_load.py). What a request failed in is a (pair, mode): a
  retry or a migration goes to the same mode on another pair first (pairs are alike, and the
  router chose that mode), and to another mode only when no pair can serve it.
* Failures become `APIError`s through errors.ENGINE_FAILURES, here (before the first message) and
  in `EngineStream.read` (after it), so the serving loop never sees gRPC.

Engine calls are server-streaming `Generate` RPCs on the engine that serves the mode
(services/modes.py: the decoding one; in hybrid mode it pulls the KV from the prefilling one).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import grpc

from services.gateway import metrics as m
# NEVER_MIGRATE and Migration: engine_stream.py's, named here too (the rules are written here)
from services.gateway.engine_stream import NEVER_MIGRATE, EngineStream, Migration  # noqa: F401
from services.gateway.errors import APIError, engine_error
from services.gateway.pairs import Engines, Pairs
from services.gateway.planner import Planner
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
                                     frequency_penalty=body.frequency_penalty or 0.0,
                                     presence_penalty=body.presence_penalty or 0.0,
                                     repetition_penalty=body.repetition_penalty or 1.0,
                                     logit_bias=body.bias_pairs(), min_tokens=body.min_tokens or 0,
                                     stop_token_ids=body.stop_token_ids or [],
                                     **({"seed": body.seed} if body.seed is not None else {}))
        if body.top_logprobs_asked is not None:
            sampling.logprobs = body.top_logprobs_asked
        if getattr(body, "prompt_logprobs_asked", None) is not None:
            sampling.prompt_logprobs = body.prompt_logprobs_asked
        sampling.n = body.choices_generated
        if body.grammar:
            sampling.grammar = body.grammar
        if sampling.n > body.n and not sampling.HasField("logprobs"):
            sampling.logprobs = 0  # best_of ranks the choices by their cumulative logprob
        return cls(request_id, prompt_ids, max_tokens, sampling, None if body.mode == AUTO else body.mode,
                   min(body.timeout or max_timeout_s, max_timeout_s))

    def choice(self, index: int) -> "EngineRequest":
        """Choice `index` of this request (n > 1) as a request of its own: one choice, drawing that choice's
        random numbers (`first_choice`); what a migration continues that choice from."""
        sampling = pb.SamplingParams()
        sampling.CopyFrom(self.sampling)
        sampling.n, sampling.first_choice = 1, index
        sampling.ClearField("prompt_logprobs")  # the client has the prompt's already
        return replace(self, request_id=f"{self.request_id}-c{index}", sampling=sampling)

    def continuation(self, generated: list[int], timeout_s: float, n: int) -> "EngineRequest":
        """The rest of this request once `generated` are out: they join the prompt and leave max_tokens.

        `n`: the how-many-th migration, in the engine-side request id (the dead call's id may still
        name KV or an arena slot on the engine that lives).
        """
        rest = self.max_tokens - len(generated)
        sampling = pb.SamplingParams()
        sampling.CopyFrom(self.sampling)
        sampling.max_tokens = rest
        # the tokens out so far are the new call's prompt: the engine still counts them as output
        # (frequency and presence penalties, min_tokens); `self` is always the request as first sent
        sampling.prior_output_tokens = len(generated)
        sampling.ClearField("prompt_logprobs")  # the client has the prompt's already
        return replace(self, request_id=f"{self.request_id}-m{n}", prompt_ids=self.prompt_ids + generated,
                       max_tokens=rest, sampling=sampling, forced=None, timeout_s=timeout_s)


class Dispatcher:
    """Routes with `router` among the modes the pairs can serve; opens the call on the right engine
    of the least loaded pair. `pairs`: a Pairs, or one pair's clients."""

    def __init__(self, pairs: Pairs | Engines, router: Router):
        self.pairs = pairs if isinstance(pairs, Pairs) else Pairs([pairs])
        self.router = router
        self.planner: Planner | None = None  # told of each request admitted (the pools' sizing signal)

    def route(self, n_in: int, max_tokens: int, forced: str | None, attempt: int = 0,
              failed: frozenset = frozenset(), prefer: str | None = None) -> Decision:
        """The mode. `failed`: (pair, mode)s this request's earlier attempts failed in. `prefer`: a
        mode to keep when some pair can still serve it (a migration's old mode)."""
        up = [name for name in MODES if self.pairs.serving(name, failed)]
        if forced is not None:
            if forced not in up:
                down = [ENGINE_NAMES[e] for e in MODES[forced].engines if not self.pairs.engine_up_anywhere(e)]
                needs = ", ".join(down) if down else "both engines of one pair"
                raise APIError(503, f"mode {forced} needs {needs}, which is down", "mode",
                               "engine_unavailable")
            if not self._fits(forced, n_in + max_tokens):
                raise APIError(400, f"prompt ({n_in} tokens) + max_tokens ({max_tokens}) exceeds the context "
                                    f"window of mode {forced}", "max_tokens", "context_length_exceeded")
            return self.router.choose(n_in, max_tokens, forced=forced, available=up)
        if not up:
            raise APIError(503, "no engine is up to serve this request", code="engine_unavailable")
        fitting = [name for name in up if self._fits(name, n_in + max_tokens)]
        if not fitting:
            self._too_long(up, n_in, max_tokens)
        if prefer in fitting:
            d = self.router.choose(n_in, max_tokens, forced=prefer, available=fitting)
        else:
            d = self.router.choose(n_in, max_tokens, available=fitting)
        every_mode = attempt == 0 and len(fitting) == len(MODES)
        if d.reason == "explore":
            return d
        return replace(d, reason="auto" if every_mode else "fallback")

    async def open(self, req: EngineRequest) -> EngineStream:
        """Route and call, retrying as the module docstring says; the call once its first message is in."""
        if self.planner is not None:
            self.planner.arrived(len(req.prompt_ids), req.max_tokens)
        call, decision, first = await self.call(req)
        return EngineStream(self, req, call, decision, first)

    async def call(self, req: EngineRequest, failed: frozenset = frozenset(), reason: str | None = None,
                   prefer: str | None = None):
        """(call, decision, first message): routed among the (pair, mode)s up but `failed`, retried on
        RETRY_ON; the decision names the pair.

        `reason`: the decision's reason when it is not the router's own ("migration"); `prefer`: route().
        """
        attempt = 0
        while True:
            d = self.route(len(req.prompt_ids), req.max_tokens, req.forced, attempt, failed, prefer)
            placed = self.pairs.place(d.mode, req.prompt_ids, failed)
            d = replace(d, reason=reason or d.reason, pair=placed.pair, placement=placed)
            mode, clients = MODES[d.mode], self.pairs.members[d.pair]
            # counted on the pair from now (requests arriving together must see each other), until
            # the stream is cancelled, or here when the call fails before its first message
            self.pairs.loads.started(d.pair, d.mode)
            call = clients.generate(mode.served_by, pb.GenerateRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_ids, sampling=req.sampling, mode=mode.proto,
                prefill_address=self.pairs.prefill_address(d.pair, d.mode)), timeout=req.timeout_s)
            # on the router's queue too until the first message, from when the Run serving the stream
            # counts it: a burst's requests are routed while the first ones wait for their first
            # tokens, and each must see the others (counted only from the Run, a burst of 8 found
            # idle engines 8 times, and sent its long prompts to hybrid beside fpga's prefills)
            self.router.started(d.mode, d.prefill_s)  # its prompt is ahead of the next ones' until then
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as exc:
                self.pairs.loads.finished(d.pair, d.mode)
                if self._retries(exc, req, attempt):
                    log.info("request %s (%s mode, pair %d): %s; routing again", req.request_id, d.mode, d.pair,
                             exc.code().name)
                    for engine in mode.engines:
                        await clients.check(engine)  # which one is gone decides the next route
                    attempt, failed = attempt + 1, failed | {(d.pair, d.mode)}
                    prefer = prefer or d.mode  # the same mode on another pair first
                    continue
                err = engine_error(exc, d.mode, req.request_id)
                if reason is None:  # a migrated request is counted once, by its serving loop
                    m.REQUESTS.labels(mode=d.mode, status=str(err.status)).inc()
                raise err from exc
            except BaseException:  # cancelled (the client went away while it waited)
                self.pairs.loads.finished(d.pair, d.mode)
                call.cancel()
                raise
            finally:
                self.router.finished(d.mode, prefill_s=d.prefill_s)  # the Run takes it over (no await in between)
            if first is grpc.aio.EOF:
                self.pairs.loads.finished(d.pair, d.mode)
                log.warning("request %s (%s mode): the engine ended the call without a token", req.request_id, d.mode)
                if reason is None:
                    m.REQUESTS.labels(mode=d.mode, status="502").inc()
                raise APIError(502, "the engine ended the call without a token", code="engine_error")
            m.DECISIONS.labels(mode=d.mode, reason=d.reason).inc()
            m.PAIR_CALLS.labels(pair=str(d.pair), mode=d.mode).inc()
            if len(self.pairs) > 1:
                m.PAIR_PLACEMENTS.labels(reason=placed.reason).inc()
                m.PREFIX_HIT_TOKENS.inc(placed.hit_tokens)
                m.PREFIX_QUERY_TOKENS.inc(len(req.prompt_ids))
            return call, d, first

    def _retries(self, exc: grpc.aio.AioRpcError, req: EngineRequest, attempt: int) -> bool:
        # one more attempt per extra pair: a pair that died since the last health check costs one; a
        # forced mode may go to another pair (the same mode), never to another mode
        return (exc.code() in RETRY_ON and (req.forced is None or len(self.pairs) > 1)
                and attempt + 1 < MAX_ATTEMPTS + len(self.pairs) - 1)

    def check_window(self, n_in: int, max_tokens: int, forced: str | None) -> None:
        """The 400 `route` would answer when no mode up (or the forced one) holds the prompt + max_tokens;
        nothing when no engine is up (the route's 503 says so). For a request of several prompts, checked
        for each before any call."""
        up = [name for name in MODES if self.pairs.serving(name)]
        names = [forced] if forced in up else [] if forced is not None else up
        if names and not any(self._fits(name, n_in + max_tokens) for name in names):
            self._too_long(names, n_in, max_tokens)

    def _too_long(self, modes: list[str], n_in: int, max_tokens: int):
        window = max(self._window(name) for name in modes)
        raise APIError(400, f"prompt ({n_in} tokens) + max_tokens ({max_tokens}) exceeds the context window "
                            f"of {window} tokens", "max_tokens", "context_length_exceeded")

    def context_window(self) -> int:
        """The longest context a mode up now holds (prompt + output tokens); 0 while none is up."""
        return max((self._window(name) for name in MODES if self.pairs.serving(name)), default=0)

    def _window(self, mode: str) -> int:
        return min(self.pairs.context_of(e) for e in MODES[mode].engines)

    def _fits(self, mode: str, n_total: int) -> bool:
        return n_total <= self._window(mode)
