"""A completions request with several prompts (`prompt` as a list: lm-evaluation-harness sends its
batch so): one engine call per prompt, each routed on its own (its own mode, pair, retry and
migration), their texts merged into one answer whose choices are indexed prompt-major (prompt i's
choice j is `i * n + j`, as OpenAI does) and whose usage sums the prompts'.

`PromptsRun` stands where serving.py's one-prompt `Run` and its `EngineStream` stand: the serving
code reads its `choices`, `usage()`, `extension()` and `best(n)`, and iterates `serve()`. Each
prompt keeps its own `Run` (its accounting, metrics and router queue, as a request of its own).

At most `in_flight` prompts have an engine call open at once: the first ones are opened before
the response starts (so a refusal is the response's status), the others as earlier ones finish,
so one request never floods an engine's queue with its own prompts; a prompt an engine refuses as
at capacity while others of the request are open waits for one of them to finish and is tried again.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import replace
from typing import AsyncIterator

from services.gateway.dispatch.dispatcher import Dispatcher
from services.gateway.dispatch.engine_stream import EngineStream
from services.gateway.dispatch.request import RoutedRequest
from services.gateway.dispatch.serving import Run
from services.gateway.output.choice import Choice
from services.gateway.protocol.errors import APIError
from services.gateway.protocol.openai_format import Hybridserve, Usage
from services.gateway.routing.policy import ModePolicy


class PromptsRun:
    tool_names: set[str] | None = None  # as Run's: tools are chat's, and chat has one prompt

    def __init__(self, dispatcher: Dispatcher, router: ModePolicy, request: RoutedRequest, prompts: list[list[int]],
                 choices: list[list[Choice]], in_flight: int, started: float):
        """`request`: the engine request of prompt 0 (the others differ by prompt and id); `choices`: each
        prompt's, already carrying their client-side (prompt-major) index."""
        self.request_id = request.request_id
        self._dispatcher, self._router, self._in_flight = dispatcher, router, max(1, in_flight)
        self._requests = [replace(request, request_id=request.request_id if i == 0 else f"{request.request_id}-p{i}",
                                  prompt_ids=ids) for i, ids in enumerate(prompts)]
        self._choices = choices
        self.runs: list[Run | None] = [None] * len(prompts)  # each prompt's, once its call is open
        self._streams: list[EngineStream | None] = [None] * len(prompts)
        self._room = asyncio.Condition()  # guards the two counts below
        self._calls = 0  # of this request's engine calls open now
        self._finished = 0  # prompts served to their end
        self.started = started

    @property
    def choices(self) -> list[Choice]:
        return [c for cs in self._choices for c in cs]

    @property
    def done(self) -> bool:
        return all(c.finish_reason for c in self.choices)

    @property
    def migrations(self) -> list:
        return [mg for run in self.runs if run is not None for mg in run.migrations]

    @property
    def modes(self) -> str:
        """Each prompt's mode, in order (the response header)."""
        return ",".join(run.decision.mode if run else "" for run in self.runs)

    @property
    def pairs(self) -> str:
        return ",".join(str(run.decision.pair) if run else "" for run in self.runs)

    async def open(self) -> None:
        """Open the first `in_flight` prompts' calls together. A prompt an engine refuses as at capacity
        (429) while another of this request's is open waits for one to finish (the request's own prompts
        fill the engine); any other failure closes the calls opened and is raised."""
        first = range(min(self._in_flight, len(self._requests)))
        self._calls = len(first)
        results = await asyncio.gather(*(self._open(i) for i in first), return_exceptions=True)
        opened = [i for i in first if self._streams[i] is not None]
        failed = [r for r in results if isinstance(r, BaseException)]
        self._calls = len(opened)
        if any(not _at_capacity(r) for r in failed) or not opened:
            for i in opened:
                self._streams[i].cancel()
                self.runs[i].finish("499")  # closed unserved: not this prompt's failure
            raise next((r for r in failed if not _at_capacity(r)), failed[0])

    async def _open(self, i: int) -> None:
        stream = await self._dispatcher.open(self._requests[i])
        self._streams[i] = stream
        self.runs[i] = Run(self._router, stream.decision, len(self._requests[i].prompt_ids), self.started,
                           self._choices[i])

    async def _open_when_room(self, i: int) -> None:
        """Open prompt i's call once fewer than `in_flight` of this request's are open; when the engine is
        at capacity and another of them is open, again after one of them finished."""
        while True:
            async with self._room:
                await self._room.wait_for(lambda: self._calls < self._in_flight)
                self._calls += 1
                finished = self._finished
            try:
                await self._open(i)
                return
            except APIError as err:
                async with self._room:
                    self._calls -= 1
                    if not _at_capacity(err) or self._calls == 0:
                        raise
                    await self._room.wait_for(lambda: self._finished > finished)

    async def _closed(self) -> None:
        async with self._room:
            self._calls -= 1
            self._finished += 1
            self._room.notify_all()

    def serve(self, _stream=None) -> AsyncIterator[tuple[int, str]]:
        return self._serve()

    async def _serve(self) -> AsyncIterator[tuple[int, str]]:
        """(choice index, text), from every prompt's `serving.serve` as it comes; the first failure
        ends them all (each one's call cancelled, its accounting settled) and is raised."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                if self._streams[i] is None:
                    await self._open_when_room(i)
                try:
                    async with aclosing(self.runs[i].serve(self._streams[i])) as texts:
                        async for item in texts:
                            queue.put_nowait(("text", item))
                finally:
                    await self._closed()
                queue.put_nowait(("end", i))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait(("error", exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self._requests))]
        try:
            ended = 0
            while ended < len(tasks):
                kind, payload = await queue.get()
                if kind == "error":
                    raise payload
                if kind == "end":
                    ended += 1
                    continue
                yield payload
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for i, stream in enumerate(self._streams):  # opened but never served (a failure came first)
                if stream is not None and self.runs[i] is not None and not self.runs[i].ended:
                    stream.cancel()
                    self.runs[i].finish("499")

    def usage(self) -> Usage:
        return Usage.of(sum(len(r.prompt_ids) for r in self._requests),
                        sum(c.n_out for c in self.choices))

    def extension(self) -> Hybridserve:
        each = [run.extension() for run in self.runs if run is not None]
        return each[0].model_copy(update={"prompts": each})

    def best(self, n: int) -> list[Choice]:
        """Each prompt's n to return (best_of: its best), prompt after prompt."""
        return [c for run in self.runs for c in run.best(n)]


def _at_capacity(exc: BaseException) -> bool:
    return isinstance(exc, APIError) and exc.status == 429
