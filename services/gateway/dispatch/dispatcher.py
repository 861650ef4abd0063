"""From a routed request to an open engine call; retry and fallback are decided here and nowhere else,
and the migration rules are written here (engine_stream.py carries them out: an open call's
messages, and its continuation when its engine is lost, through `Dispatcher.call`).

* Route (`Dispatcher.route`): the candidates are the modes whose engines are all up and whose
  context windows hold prompt + max_tokens. A forced mode must be a candidate, or the request is
  refused (503 when an engine it needs is down, 400 when it does not fit). Otherwise the policy
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
from dataclasses import replace

import grpc

from services.gateway import metrics as m
# NEVER_MIGRATE and Migration: engine_stream.py's, named here too (the rules are written here)
from services.gateway.dispatch.engine_stream import NEVER_MIGRATE, EngineStream, Migration  # noqa: F401
from services.gateway.dispatch.request import RoutedRequest
from services.gateway.fleet.pairs import Engines, Pairs
from services.gateway.fleet.planner import Planner
from services.gateway.protocol.errors import APIError, engine_error
from services.gateway.routing.policy import Decision, ModePolicy
from services.modes import ENGINE_NAMES, MODES
from services.rpc.hybridserve.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

RETRY_ON = frozenset({grpc.StatusCode.UNAVAILABLE})  # the engine may be gone: the health check tells
MAX_ATTEMPTS = 2


class Dispatcher:
    """Routes with `policy` (routing/policy.py; `auto`: the router) among the modes the pairs can serve;
    opens the call on the right engine of the least loaded pair. `pairs`: a Pairs, or one pair's clients."""

    def __init__(self, pairs: Pairs | Engines, policy: ModePolicy):
        self.pairs = pairs if isinstance(pairs, Pairs) else Pairs([pairs])
        self.policy = policy
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
            return self.policy.choose(n_in, max_tokens, forced=forced, available=up)
        if not up:
            raise APIError(503, "no engine is up to serve this request", code="engine_unavailable")
        fitting = [name for name in up if self._fits(name, n_in + max_tokens)]
        if not fitting:
            self._too_long(up, n_in, max_tokens)
        if prefer in fitting:
            d = self.policy.choose(n_in, max_tokens, forced=prefer, available=fitting)
        else:
            d = self.policy.choose(n_in, max_tokens, available=fitting)
        every_mode = attempt == 0 and len(fitting) == len(MODES)
        if d.reason == "explore":
            return d
        return replace(d, reason="auto" if every_mode else "fallback")

    async def open(self, req: RoutedRequest) -> EngineStream:
        """Route and call, retrying as the module docstring says; the call once its first message is in."""
        if self.planner is not None:
            self.planner.arrived(len(req.prompt_ids), req.max_tokens)
        call, decision, first = await self.call(req)
        return EngineStream(self, req, call, decision, first, planner=self.planner)

    async def call(self, req: RoutedRequest, failed: frozenset = frozenset(), reason: str | None = None,
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
            self.policy.started(d.mode, d.prefill_s)  # its prompt is ahead of the next ones' until then
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
                self.policy.finished(d.mode, prefill_s=d.prefill_s)  # the Run takes it over (no await in between)
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

    # ---- what an open stream may ask of it (engine_stream.CallOpener), and nothing more ----------
    async def reopen(self, req: RoutedRequest, failed: frozenset, prefer: str):
        """A migration's call: `call` with the reason "migration"."""
        return await self.call(req, failed, "migration", prefer=prefer)

    async def engines_up(self, decision: Decision) -> bool:
        """Whether every engine of the decision's mode on its pair answers its health check (checked
        one by one: the next route needs them all anyway); False once discovery found the pair gone."""
        clients = self.pairs.members.get(decision.pair)
        if clients is None:
            return False
        return all([await clients.check(e) for e in MODES[decision.mode].engines])

    def release(self, decision: Decision) -> None:
        """A call ended: its load on its pair is given back."""
        self.pairs.loads.finished(decision.pair, decision.mode)

    def _retries(self, exc: grpc.aio.AioRpcError, req: RoutedRequest, attempt: int) -> bool:
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
