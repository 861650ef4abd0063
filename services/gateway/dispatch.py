"""From a routed request to an open engine call; retry and fallback are decided here and nowhere else.

(Just past 300 lines on purpose: route, pair placement, the call and its retry and migration rules
share one failed-set and one load count; split apart, each half would re-derive the other's state.)

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

import asyncio
import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass, replace

import grpc

from services.gateway import metrics as m
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
MIGRATE_ON = frozenset({grpc.StatusCode.UNAVAILABLE})  # mid-stream: the engine is gone or going, whatever health says
# mid-stream failures about the request itself (or the client's deadline): another engine would fail it too
NEVER_MIGRATE = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           grpc.StatusCode.FAILED_PRECONDITION})


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


@dataclass(frozen=True)
class Migration:
    """A request (with n > 1: one of its choices) moved from one mode to another after `after_tokens` tokens."""

    from_mode: str
    to_mode: str
    after_tokens: int
    from_pair: int = 0
    to_pair: int = 0


@dataclass(eq=False)
class _Leg:
    """One engine call serving some of the request's choices: the call's choice k is the request's `choices[k]`."""

    call: object
    decision: Decision
    request: EngineRequest  # what a continuation of these choices is made from
    choices: list[int]
    ended: bool = False  # cancelled, its load on its pair given back


async def _read(call):
    """The call's next message, or the error it failed with (so that reads of several calls can be waited on)."""
    try:
        return await call.read()
    except grpc.aio.AioRpcError as exc:
        return exc


class EngineStream:
    """The Generate call(s) of one client request, once the first message has arrived.

    `read()` gives the next message, migrating to another mode when the engine is lost (module
    docstring); a failure it cannot get past, or an end before the last message, raises APIError.
    A request with n > 1 choices is one call; when that call's engine is lost, each unfinished choice
    continues in a call of its own (its prompt + its tokens so far, its own random stream), and
    `read()` gives the messages of those calls as they come, each with its choice's `index`.
    `decision` is the mode serving now (the latest call's); `migrations` says where the request has been.
    `cancel()` ends the calls, and the engines free the request's KV and arena slots.
    """

    def __init__(self, dispatcher: "Dispatcher", request: "EngineRequest", call, decision: Decision,
                 first: pb.GenerateResponse, failed: frozenset[str] = frozenset()):
        self._dispatcher, self._request = dispatcher, request
        self.decision, self.first, self.request_id = decision, first, request.request_id
        self._failed = failed  # (pair, mode)s this request failed in
        self._opened = time.monotonic()
        self._legs = [_Leg(call, decision, request, list(range(max(1, request.sampling.n))))]
        self._reads: dict[_Leg, asyncio.Task] = {}  # with several calls: the read pending on each
        self._ready: deque[pb.GenerateResponse] = deque()  # continuations' first messages, not handed out yet
        self.generated: dict[int, list[int]] = defaultdict(list)  # choice -> every token id the client has had
        self._finished: set[int] = set()  # choices whose last message is in
        self.migrations: list[Migration] = []
        self._take(self._legs[0], first)

    async def read(self) -> pb.GenerateResponse:
        if self._ready:
            return self._ready.popleft()
        live = [leg for leg in self._legs if not leg.ended and not all(c in self._finished for c in leg.choices)]
        if not live:
            raise APIError(502, "the engine ended the stream before the last token", code="engine_error")
        if len(live) == 1 and live[0] not in self._reads:  # one call: no task in the way of each token
            leg, result = live[0], await _read(live[0].call)
        else:
            for leg in live:
                if leg not in self._reads:
                    self._reads[leg] = asyncio.create_task(_read(leg.call))
            done, _ = await asyncio.wait(self._reads.values(), return_when=asyncio.FIRST_COMPLETED)
            leg = next(leg for leg, task in self._reads.items() if task in done)
            result = self._reads.pop(leg).result()
        if isinstance(result, grpc.aio.AioRpcError):
            if not await self._engine_lost(result.code(), leg):
                raise engine_error(result, leg.decision.mode, self.request_id) from result
            log.warning("request %s (%s mode): the engine was lost after %d tokens (%s: %s)", self.request_id,
                        leg.decision.mode, self._out(leg), result.code().name, result.details())
            return await self._migrate(leg)
        if result is grpc.aio.EOF:
            if await self._engine_lost(None, leg):
                log.warning("request %s (%s mode): the engine was lost after %d tokens (the stream ended)",
                            self.request_id, leg.decision.mode, self._out(leg))
                return await self._migrate(leg)
            log.warning("request %s (%s mode): the engine ended the stream early", self.request_id,
                        leg.decision.mode)
            raise APIError(502, "the engine ended the stream before the last token", code="engine_error")
        return self._take(leg, result)

    def cancel(self) -> None:
        for task in self._reads.values():
            task.cancel()
        self._reads.clear()
        for leg in self._legs:
            self._end(leg)

    def _take(self, leg: _Leg, msg: pb.GenerateResponse) -> pb.GenerateResponse:
        """A message of `leg`'s call, under the request's index of its choice."""
        if msg.index < len(leg.choices):  # else the serving loop refuses it (a choice the request lacks)
            msg.index = leg.choices[msg.index]
        self.generated[msg.index].extend(msg.token_ids)
        if msg.finish_reason:
            self._finished.add(msg.index)
        return msg

    def _end(self, leg: _Leg) -> None:
        leg.call.cancel()
        if not leg.ended:
            leg.ended = True
            self._dispatcher.pairs.loads.finished(leg.decision.pair, leg.decision.mode)

    def _out(self, leg: _Leg) -> int:
        return sum(len(self.generated[c]) for c in leg.choices)

    async def _engine_lost(self, code: grpc.StatusCode | None, leg: _Leg) -> bool:
        """Whether a mid-stream failure (`code`; None: the stream just ended) means the engine is gone."""
        if code in NEVER_MIGRATE:
            return False
        engines = MODES[leg.decision.mode].engines
        clients = self._dispatcher.pairs.members.get(leg.decision.pair)
        if clients is None:  # discovery found its pod gone
            return True
        up = [await clients.check(e) for e in engines]  # the next route needs them anyway
        return code in MIGRATE_ON or not all(up)

    async def _migrate(self, leg: _Leg) -> pb.GenerateResponse:
        """Re-submit the rest of `leg`'s choices to a mode that is up, one call per unfinished choice
        (each has its own tokens so far); the first of the new messages."""
        leg.call.cancel()  # it counts on its pair until the new calls are open (they are placed elsewhere)
        try:
            return await self._continue(leg)
        finally:
            self._end(leg)
            self._legs.remove(leg)

    async def _continue(self, leg: _Leg) -> pb.GenerateResponse:
        old, old_pair = leg.decision.mode, leg.decision.pair
        self._failed |= {(old_pair, old)}
        for choice in leg.choices:
            if choice in self._finished:
                continue
            base = leg.request if len(leg.choices) == 1 else leg.request.choice(choice)
            out = self.generated[choice]
            if len(out) >= base.max_tokens:  # only the finish was lost
                self._finished.add(choice)
                self._ready.append(pb.GenerateResponse(finish_reason="length", index=choice))
                continue
            left_s = self._request.timeout_s - (time.monotonic() - self._opened)
            if left_s <= 0:
                raise APIError(504, "the request did not finish within its timeout", code="timeout")
            rest = base.continuation(out, left_s, len(self.migrations) + 1)
            try:
                call, decision, first = await self._dispatcher.call(rest, self._failed, "migration", prefer=old)
            except APIError as err:
                log.warning("request %s: no mode to migrate to from %s after %d tokens: %s", self.request_id, old,
                            len(out), err.message)
                raise
            m.MIGRATIONS.labels(**{"from": old, "to": decision.mode}).inc()
            log.warning("request %s%s migrated from %s to %s mode after %d tokens (from pair %d to pair %d)",
                        self.request_id, f" (choice {choice})" if len(leg.choices) > 1 else "", old, decision.mode,
                        len(out), old_pair, decision.pair)
            self.migrations.append(Migration(old, decision.mode, len(out), old_pair, decision.pair))
            new = _Leg(call, decision, base, [choice])
            self._legs.append(new)
            self.decision = decision
            self._ready.append(self._take(new, first))
        return self._ready.popleft()


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
                request_id=req.request_id, prompt_token_ids=req.prompt_ids, sampling=req.sampling, mode=mode.proto),
                timeout=req.timeout_s)
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

    def _window(self, mode: str) -> int:
        return min(self.pairs.context_of(e) for e in MODES[mode].engines)

    def _fits(self, mode: str, n_total: int) -> bool:
        return n_total <= self._window(mode)
