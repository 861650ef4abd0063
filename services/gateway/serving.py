"""From an open engine call to the client's answer: one loop, `serve`, turns the engine's token
messages into text (detokenized, stop strings applied) and keeps the request's usage, timings and
metrics; `unary_response` and `sse_events` are the two ways of handing that text to the client.

However a request ends (its last token, a stop string, an engine failure, the client gone), `serve`
cancels the engine call, which frees the request's KV and arena slot upstream, and settles the
request's accounting once.

An engine lost mid-stream is dispatch.py's business: `EngineStream.read` migrates the request and
goes on with the next token, and `Run.follow` moves the request's accounting to the new mode. A
failure the stream cannot get past ends a streamed response with an error event, then `[DONE]`,
as any stream ends.
"""
from __future__ import annotations

import logging
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from services.gateway import metrics as m
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.dispatch import EngineStream
from services.gateway.errors import APIError, error_body
from services.gateway.logprobs_format import LogprobsWriter
from services.gateway.openai_format import (SSE_DONE, AssistantMessage, ChatChoice, ChatCompletion, ChunkWriter,
                                            Completion, CompletionChoice, Hybridserve, MigrationRecord, Timings,
                                            Usage, sse)
from services.gateway.router import Decision, Router, samples_from_timings
from services.gateway.stops import StopMatcher
from services.rpc.hybridserve.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, given back before its completion (`echo`): its text and its token ids."""

    text: str
    prompt_ids: list[int]


class Run:
    """One request's progress and its accounting: metrics, the router's queue, its calibration.

    Counts the request on its mode's engines from construction until `finish`.
    """

    def __init__(self, router: Router, decision: Decision, n_in: int, started: float,
                 detok: IncrementalDetokenizer, stops: StopMatcher, logprobs: LogprobsWriter | None = None,
                 echo: "Echo | None" = None, show_output: bool = True):
        self.router, self.decision, self.n_in, self.started = router, decision, n_in, started
        self.detok, self.stops = detok, stops
        self.logprobs = logprobs  # None: the request did not ask for them
        self.entries: list = []  # (token id, pb.TokenLogprob) of every token taken, when asked for
        self.echo = echo  # the prompt, given back before the first token's text (then None)
        self.show_output = show_output  # False: max_tokens 0, the one token the engine made is not shown
        self.n_out = 0
        self.finish_reason: str | None = None
        self.engine_timings: pb.Timings | None = None  # from the engine's last message
        self.last_token_at: float | None = None
        self.serving = decision  # differs from `decision` once the request migrated
        self.migrations: list = []  # dispatch.Migration, as the stream made them
        self._on_mode_since = started
        router.started(decision.mode)

    def follow(self, stream: EngineStream) -> None:
        """After a read: if the stream migrated, the request now queues on its new mode's engines."""
        if stream.decision is self.serving:
            return
        now = time.perf_counter()
        self.router.finished(self.serving.mode, now - self._on_mode_since)
        self.router.started(stream.decision.mode)
        self.serving, self.migrations, self._on_mode_since = stream.decision, list(stream.migrations), now

    def take(self, msg: pb.GenerateResponse) -> str:
        """Account for one engine message; the text it adds (after stop strings)."""
        now = time.perf_counter()
        mode = self.serving.mode
        for _ in msg.token_ids:
            if self.last_token_at is None:
                m.TTFT.labels(mode=mode).observe(now - self.started)
            else:
                m.ITL.labels(mode=mode).observe(now - self.last_token_at)
            self.last_token_at = now
        text = ""
        if self.echo is not None:
            text, ids = self.echo.text, self.echo.prompt_ids
            if self.logprobs is not None:  # the first prompt token has nothing before it: no logprob
                self.entries += [(ids[0], None), *zip(ids[1:], msg.prompt_logprobs)]
            self.echo = None
        if not self.show_output:
            if msg.finish_reason:
                self.finish_reason, self.engine_timings = "length", msg.timings
            return text
        if self.logprobs is not None and not self.stops.stopped:
            self.entries.extend(zip(msg.token_ids, msg.logprobs))
        for t in msg.token_ids:
            self.n_out += 1
            text += self.stops.feed(self.detok.add(t))
        if msg.finish_reason:
            self.finish_reason, self.engine_timings = msg.finish_reason, msg.timings
            text += self.stops.feed(self.detok.flush()) + self.stops.flush()
        if self.stops.stopped:
            self.finish_reason = "stop"
        return text

    def finish(self, status: str) -> None:
        """`status`: the HTTP status as a metrics label ("499": the client went away)."""
        mode, e2e = self.decision.mode, time.perf_counter() - self.started
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
        if self.engine_timings is not None and self.finish_reason and not self.stops.stopped:
            self.router.observe(samples_from_timings(mode, self.n_in, self.timings().model_dump(),
                                                     self.decision.company))

    def timings(self) -> Timings:
        t = self.engine_timings or pb.Timings()
        return Timings(queue_s=t.queue_s, prefill_s=t.prefill_s, handoff_total_s=t.handoff_total_s,
                       handoff_exposed_s=t.handoff_exposed_s, decode_s=t.decode_s,
                       decode_tokens=max(0, t.generated_tokens - 1), handoff_bytes=t.handoff_bytes,
                       cached_tokens=t.cached_tokens,
                       e2e_s=time.perf_counter() - self.started)

    def extension(self) -> Hybridserve:
        d = self.decision
        moves = [MigrationRecord(from_mode=mg.from_mode, to_mode=mg.to_mode, after_tokens=mg.after_tokens,
                                 from_pair=mg.from_pair, to_pair=mg.to_pair) for mg in self.migrations]
        return Hybridserve(mode=d.mode, reason=d.reason, estimates=d.estimates, timings=self.timings(),
                           migrations=moves or None)

    def usage(self) -> Usage:
        return Usage.of(self.n_in, self.n_out)

    def take_logprobs(self, none_if_empty: bool = False):
        """The logprobs of the tokens taken since the last call, in the endpoint's shape; None if not asked
        (or, `none_if_empty`, if no token came since)."""
        if self.logprobs is None or (none_if_empty and not self.entries):
            return None
        entries, self.entries = self.entries, []
        return self.logprobs.format(entries)


async def serve(run: Run, stream: EngineStream) -> AsyncIterator[str]:
    """The text each engine message adds (maybe ""), until the finish; `run.finish_reason` is set then.

    Raises APIError when the engine fails. Closing the generator early means the client went away.
    """
    status = "499"  # until the last message is in, an end means the client went away
    try:
        msg = stream.first
        while True:
            yield run.take(msg)
            if run.finish_reason:
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


async def unary_response(run: Run, stream: EngineStream, request: Request, model: str, chat: bool,
                         headers: dict) -> Response:
    pieces: list[str] = []
    async with aclosing(serve(run, stream)) as texts:
        async for text in texts:
            pieces.append(text)
            if not run.finish_reason and await request.is_disconnected():
                return Response(status_code=499)  # leaving the block closes `serve`: the call is cancelled
    if run.migrations:  # the response has not started: its headers can say it
        headers = {**headers, "x-hybridserve-migrations": ",".join(
            f"{mg.from_mode}->{mg.to_mode}@{mg.after_tokens}" for mg in run.migrations)}
    text, rid, created = "".join(pieces), stream.request_id, int(time.time())
    logprobs = run.take_logprobs()
    if chat:
        body = ChatCompletion(id=rid, created=created, model=model, usage=run.usage(), hybridserve=run.extension(),
                              choices=[ChatChoice(message=AssistantMessage(content=text),
                                                  finish_reason=run.finish_reason, logprobs=logprobs)])
    else:
        body = Completion(id=rid, created=created, model=model, usage=run.usage(), hybridserve=run.extension(),
                          choices=[CompletionChoice(text=text, finish_reason=run.finish_reason, logprobs=logprobs)])
    return Response(body.model_dump_json(), media_type="application/json", headers=headers)


async def sse_events(run: Run, stream: EngineStream, chunks: ChunkWriter, include_usage: bool) -> AsyncIterator[str]:
    """The stream's events. The response is already a 200: a failure is sent as its last event."""
    try:
        async with aclosing(serve(run, stream)) as texts:
            opening = chunks.chat  # sent from inside the loop, so `serve` has started and will clean up
            async for text in texts:
                if opening:
                    yield sse(chunks.role())
                    opening = False
                logprobs = run.take_logprobs(none_if_empty=True)
                if text or logprobs is not None:
                    yield sse(chunks.text(text, logprobs))
        yield sse(chunks.finish(run.finish_reason, run.extension()))
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
