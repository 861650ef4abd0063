"""From an open engine call to the client's answer: one loop, `serve`, turns the engine's token
messages into text (detokenized, stop strings applied) and keeps the request's usage, timings and
metrics; `unary_response` and `sse_events` are the two ways of handing that text to the client.

However a request ends (its last token, a stop string, an engine failure, the client gone), `serve`
cancels the engine call, which frees the request's KV and arena slot upstream, and settles the
request's accounting once.

An engine lost mid-stream is dispatcher.py's business: `EngineStream.read` migrates the request and
goes on with the next token, and `Run.follow` moves the request's accounting to the new mode. A
failure the stream cannot get past ends a streamed response with an error event, then `[DONE]`,
as any stream ends.
"""
from __future__ import annotations

import logging
import time
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from services import token_trace
from services.gateway import metrics as m
from services.gateway.dispatch.engine_stream import EngineStream
from services.gateway.output.choice import Choice
from services.gateway.protocol.errors import APIError, error_body
from services.gateway.protocol.openai_format import (SSE_DONE, ChatChoice, ChatCompletion, ChunkWriter, Completion,
                                                     CompletionChoice, Hybridserve, MigrationRecord, Timings, Usage,
                                                     sse)
from services.gateway.protocol.tools import assistant_message
from services.gateway.routing.policy import Decision, ModePolicy
from services.gateway.routing.samples import samples_from_timings
from services.rpc.hybridserve.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)


class Run:
    """One request's progress and its accounting: metrics, the router's queue, its calibration.
    Its choices (choice.py; one unless n > 1) keep their own text, stops and logprobs.

    Counts the request on its mode's engines from construction until `finish`.
    """

    tool_names: set[str] | None = None  # chat with tools offered: calls of them become tool_calls (tools.py)
    planner = None  # told of each TTFT and token gap (planner.py's latency floor); `serve` sets it

    def __init__(self, router: ModePolicy, decision: Decision, n_in: int, started: float, choices: list[Choice]):
        self.router, self.decision, self.n_in, self.started = router, decision, n_in, started
        self.choices = choices
        self.prompt_logprobs: list = []  # echo with logprobs: the engine's, on choice 0's first message
        self.engine_timings: pb.Timings | None = None  # from the engine's last message (choice 0's)
        self.last_token_at: float | None = None
        self.serving = decision  # differs from `decision` once the request migrated
        self.migrations: list = []  # dispatch.Migration, as the stream made them
        self._on_mode_since = started
        self.ended = False  # `finish` has settled the accounting
        router.started(decision.mode)

    @property
    def done(self) -> bool:
        return all(c.finish_reason for c in self.choices)

    @property
    def finish_reason(self) -> str | None:
        """The first choice's (with n = 1: the request's)."""
        return self.choices[0].finish_reason

    @property
    def n_out(self) -> int:
        return sum(c.n_out for c in self.choices)

    def follow(self, stream: EngineStream) -> None:
        """After a read: if the stream migrated, the request now queues on its new mode's engines."""
        if stream.decision is self.serving:
            return
        now = time.perf_counter()
        self.router.finished(self.serving.mode, now - self._on_mode_since)
        self.router.started(stream.decision.mode)
        self.serving, self.migrations, self._on_mode_since = stream.decision, list(stream.migrations), now

    def _teach_first_token(self, seconds: float) -> None:
        """The router learns what its mode's stages miss before a first token (router.py) as soon as
        the token is here: a burst's later requests are routed on it, not only after whole requests."""
        d = self.serving
        if self.migrations or not d.first_token or d.mode not in d.first_token:
            return  # a request moved before its first token: the time is not one mode's
        self.router.observe_first_token(d.mode, d.first_token[d.mode], (d.missed or {}).get(d.mode, 0.0), seconds)

    def take(self, msg: pb.GenerateResponse) -> tuple[int, str]:
        """Account for one engine message; its choice and the text it adds there (after stop strings)."""
        now = time.perf_counter()
        mode = self.serving.mode
        for _ in msg.token_ids:
            if self.last_token_at is None:
                m.TTFT.labels(mode=mode).observe(now - self.started)
                self._teach_first_token(now - self.started)
                if self.planner is not None:
                    self.planner.observe("ttft", mode, now - self.started)
            else:
                m.ITL.labels(mode=mode).observe(now - self.last_token_at)
                if self.planner is not None:
                    self.planner.observe("itl", mode, now - self.last_token_at)
            self.last_token_at = now
        if msg.index >= len(self.choices):
            raise APIError(502, "the engine answered for a choice the request does not have", code="engine_error")
        if msg.prompt_logprobs:
            self.prompt_logprobs = list(msg.prompt_logprobs)
        choice = self.choices[msg.index]  # the engine's index; the client's is choice.index (several prompts)
        text = choice.take(msg, self.prompt_logprobs)
        if msg.finish_reason and (msg.index == 0 or self.engine_timings is None):
            self.engine_timings = msg.timings
        return choice.index, text

    def finish(self, status: str) -> None:
        """`status`: the HTTP status as a metrics label ("499": the client went away)."""
        mode, e2e = self.decision.mode, time.perf_counter() - self.started
        self.ended = True
        m.REQUESTS.labels(mode=mode, status=status).inc()
        m.PROMPT_TOKENS.inc(self.n_in)
        m.GENERATION_TOKENS.inc(self.n_out)
        self.router.finished(self.serving.mode, time.perf_counter() - self._on_mode_since)
        if status != "200":
            return
        m.E2E.labels(mode=mode).observe(e2e)
        if self.migrations:  # the estimates and the engine's timings were not of one whole run
            return
        predicted = self.decision.estimates.get(mode)
        if predicted is not None and e2e > 0:
            m.ESTIMATE_ERROR.labels(mode=mode).observe(abs(predicted - e2e) / e2e)
        # a stop string cut the engine short: its timings are not a whole request's
        if self.engine_timings is not None and self.done and len(self.choices) == 1 \
                and not self.choices[0].stops.stopped:
            self.router.observe(samples_from_timings(mode, self.n_in, self.timings().model_dump(),
                                                     self.router.lifetime_company(self.decision.company)))

    def timings(self) -> Timings:
        t = self.engine_timings or pb.Timings()
        return Timings(queue_s=t.queue_s, prefill_s=t.prefill_s, handoff_total_s=t.handoff_total_s,
                       handoff_exposed_s=t.handoff_exposed_s, decode_s=t.decode_s,
                       decode_tokens=max(0, t.generated_tokens - 1), handoff_bytes=t.handoff_bytes,
                       cached_tokens=t.cached_tokens, draft_tokens=t.draft_tokens,
                       accepted_draft_tokens=t.accepted_draft_tokens,
                       e2e_s=time.perf_counter() - self.started)

    def extension(self) -> Hybridserve:
        d = self.decision
        moves = [MigrationRecord(from_mode=mg.from_mode, to_mode=mg.to_mode, after_tokens=mg.after_tokens,
                                 from_pair=mg.from_pair, to_pair=mg.to_pair) for mg in self.migrations]
        placed = d.placement.record() if d.placement is not None and d.placement.reason != "only" else None
        return Hybridserve(mode=d.mode, reason=d.reason, estimates=d.estimates, timings=self.timings(),
                           migrations=moves or None, placement=placed)

    def usage(self) -> Usage:
        t = self.engine_timings or pb.Timings()  # every choice's tokens, best_of's unreturned ones too
        return Usage.of(self.n_in, self.n_out, t.draft_tokens, t.accepted_draft_tokens)

    def best(self, n: int) -> list[Choice]:
        """The n choices to return: all of them, or (best_of) the n of highest cumulative logprob."""
        if n >= len(self.choices):
            return self.choices
        return sorted(self.choices, key=lambda c: -c.cumulative_logprob)[:n]

    def serve(self, stream: EngineStream) -> AsyncIterator[tuple[int, str]]:
        return serve(self, stream)  # prompts.py's several-prompt run serves its own way


async def serve(run: Run, stream: EngineStream) -> AsyncIterator[tuple[int, str]]:
    """(choice, the text an engine message adds there, maybe ""), until every choice finished.

    Raises APIError when the engine fails. Closing the generator early means the client went away.
    """
    status = "499"  # until the last message is in, an end means the client went away
    run.planner = getattr(stream, "planner", None)
    n, rid = 0, stream.request_id  # tokens so far, for token_trace
    try:
        msg = stream.first
        while True:
            if token_trace.ON:
                n += len(msg.token_ids)
                token_trace.mark(rid, "recv", n)
                taken = run.take(msg)
                token_trace.mark(rid, "detok", n)
                yield taken
            else:
                yield run.take(msg)
            if run.done:
                break
            msg = await stream.read()
            run.follow(stream)
        status = "200"
    except APIError as err:
        status = str(err.status)
        raise
    except Exception:
        status = "500"
        raise
    finally:
        stream.cancel()
        run.finish(status)
        if token_trace.ON:
            token_trace.flush(rid)


async def unary_response(run: Run, stream: EngineStream, request: Request, model: str, chat: bool,
                         headers: dict, n: int = 1) -> Response:
    """`n`: the choices to return (best_of: fewer than the run has, the best by cumulative logprob)."""
    pieces: list[list[str]] = [[] for _ in run.choices]
    async with aclosing(run.serve(stream)) as texts:
        async for index, text in texts:
            pieces[index].append(text)
            if not run.done and await request.is_disconnected():
                return Response(status_code=499)  # leaving the block closes `serve`: the call is cancelled
    if run.migrations:  # the response has not started: its headers can say it
        headers = {**headers, "x-hybridserve-migrations": ",".join(
            f"{mg.from_mode}->{mg.to_mode}@{mg.after_tokens}" for mg in run.migrations)}
    rid, created = stream.request_id, int(time.time())
    returned = run.best(n)
    if chat:
        choices = [ChatChoice(index=i, message=message, finish_reason=finish, logprobs=c.take_logprobs())
                   for i, c in enumerate(returned)
                   for message, finish in [assistant_message("".join(pieces[c.index]), c.finish_reason,
                                                             run.tool_names)]]
        body = ChatCompletion(id=rid, created=created, model=model, usage=run.usage(), hybridserve=run.extension(),
                              choices=choices)
    else:
        choices = [CompletionChoice(index=i, text="".join(pieces[c.index]), finish_reason=c.finish_reason,
                                    logprobs=c.take_logprobs()) for i, c in enumerate(returned)]
        body = Completion(id=rid, created=created, model=model, usage=run.usage(), hybridserve=run.extension(),
                          choices=choices)
    return Response(body.model_dump_json(), media_type="application/json", headers=headers)


async def sse_events(run: Run, stream: EngineStream, chunks: ChunkWriter, include_usage: bool) -> AsyncIterator[str]:
    """The stream's events. The response is already a 200: a failure is sent as its last event."""
    held: dict[int, list[str]] = {c.index: [] for c in run.choices}  # with tools: the text, until the calls are known
    try:
        async with aclosing(run.serve(stream)) as texts:
            opening = chunks.chat  # sent from inside the loop, so `serve` has started and will clean up
            async for index, text in texts:
                if opening:
                    for choice in run.choices:
                        yield sse(chunks.role(choice.index))
                    opening = False
                if run.tool_names:
                    held[index].append(text)
                    text = ""
                logprobs = run.choices[index].take_logprobs(none_if_empty=True)
                if text or logprobs is not None:
                    event = sse(chunks.text(text, logprobs, index))
                    if token_trace.ON:
                        token_trace.mark(stream.request_id, "sse", run.n_out)
                    yield event
        for i, choice in enumerate(run.choices):  # the request's extension on the last choice's finish
            finish = choice.finish_reason
            if run.tool_names:
                message, finish = assistant_message("".join(held[choice.index]), finish, run.tool_names)
                if message.tool_calls:
                    yield sse(chunks.tool_calls(message.tool_calls, choice.index))
                if message.content:
                    yield sse(chunks.text(message.content, None, choice.index))
            yield sse(chunks.finish(finish, run.extension() if i == len(run.choices) - 1 else None, choice.index))
        if include_usage:
            yield sse(chunks.usage(run.usage()))
        yield SSE_DONE
    except APIError as err:
        yield sse(err.body())
        yield SSE_DONE  # a client reading to [DONE] is told the stream is over, not left to hang
    except Exception:
        log.exception("request %s: unexpected error while streaming", stream.request_id)
        yield sse(error_body(500, "internal error in the gateway; see its log", code="internal_error"))
        yield SSE_DONE
