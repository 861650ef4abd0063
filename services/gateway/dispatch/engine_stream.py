"""An open engine call, as the serving loop reads it: `EngineStream` gives the call's messages and,
when the engine is lost mid-stream, migrates the rest of the request (the rules are in dispatcher.py's
docstring) so the reader gets the new call's messages as if nothing happened. A request of n > 1
choices is one call at first; after a loss each unfinished choice continues in a call of its own,
and the stream merges those calls' messages under the choices' indices.

Opening calls (route, place, retry) is the Dispatcher's (dispatcher.py). The stream holds only a
`CallOpener`, the three things it may ask of whoever opened it: a continuation's call, whether a
call's engines are up, a call's load given back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Protocol

import grpc

from services.gateway import metrics as m
from services.gateway.dispatch.request import RoutedRequest
from services.gateway.protocol.errors import APIError, engine_error
from services.gateway.routing.policy import Decision
from services.rpc.hybridserve.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

MIGRATE_ON = frozenset({grpc.StatusCode.UNAVAILABLE})  # mid-stream: the engine is gone or going, whatever health says
# mid-stream failures about the request itself (or the client's deadline): another engine would fail it too
NEVER_MIGRATE = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           grpc.StatusCode.FAILED_PRECONDITION})


class CallOpener(Protocol):
    """What an open stream may ask of whoever opened it (the Dispatcher)."""

    async def reopen(self, request: RoutedRequest, failed: frozenset,
                     prefer: str) -> tuple[object, Decision, pb.GenerateResponse]:
        """A continuation's call, routed away from the (pair, mode)s in `failed`, `prefer`'s mode first:
        (call, decision, first message); raises APIError when no mode is left."""

    async def engines_up(self, decision: Decision) -> bool:
        """Whether the engines of the decision's mode on its pair are all up (False: the pair is gone)."""

    def release(self, decision: Decision) -> None:
        """A call that served `decision` ended: its load on its pair is given back."""


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
    request: RoutedRequest  # what a continuation of these choices is made from
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

    `read()` gives the next message, migrating to another mode when the engine is lost (dispatcher.py's
    docstring); a failure it cannot get past, or an end before the last message, raises APIError.
    A request with n > 1 choices is one call; when that call's engine is lost, each unfinished choice
    continues in a call of its own (its prompt + its tokens so far, its own random stream), and
    `read()` gives the messages of those calls as they come, each with its choice's `index`.
    `decision` is the mode serving now (the latest call's); `migrations` says where the request has been.
    `cancel()` ends the calls, and the engines free the request's KV and arena slots.
    """

    def __init__(self, opener: CallOpener, request: RoutedRequest, call, decision: Decision,
                 first: pb.GenerateResponse, failed: frozenset[str] = frozenset(), planner=None):
        self._opener, self._request = opener, request
        self.planner = planner  # told of the request's latencies by serving.Run, or None
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
            self._opener.release(leg.decision)

    def _out(self, leg: _Leg) -> int:
        return sum(len(self.generated[c]) for c in leg.choices)

    async def _engine_lost(self, code: grpc.StatusCode | None, leg: _Leg) -> bool:
        """Whether a mid-stream failure (`code`; None: the stream just ended) means the engine is gone."""
        if code in NEVER_MIGRATE:
            return False
        up = await self._opener.engines_up(leg.decision)  # False too when discovery found its pod gone
        return code in MIGRATE_ON or not up

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
                call, decision, first = await self._opener.reopen(rest, self._failed, old)
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
