"""The engine loop: one thread owns the engine, runs the scheduler's steps and streams each request's tokens.
(Past 300 lines on purpose: the loop's one step - schedule, the device call, picks, emits - reads best whole;
what a handler reads and how logit rows become picks are request_stream.py and step_results.py.)

The stream a handler reads is request_stream.py's `RequestStream`.

Request handlers (the gRPC servicers, the hybrid hand-off, the profile sweep's samples)
never call the engine's step themselves: they `submit` a request and read its
`RequestStream`. Requests join and leave between steps; a cancelled stream is dropped
from the next step and its blocks are freed. Every step is one `engine.step` call over
every running decode plus prefill chunks up to the token budget (scheduler.py), so a
long prompt never stalls the running streams for more than one chunk.

Hybrid mode, receiving side: `reserve_remote` gets a stream whose blocks the caller
fills with KV computed elsewhere (`import_kv_blocks`), then `activate_remote` hands it
the first token and it decodes with the others. Sending side: a stream submitted with
an `export` hook sees each layer of its prompt's KV as soon as the step that finishes
the prompt has it (`export(layer, block_table, n_tokens)`, on the loop thread).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Callable

from services import token_trace
from services.engine import metrics as m
from services.engine.api import BatchEngine
from services.engine.grammar import GrammarMatcher, GrammarTokenizer, prepare_masks
from services.engine.host_kv_tier import HostKVTier
from services.engine.logprobs import TokenLogprob
from services.engine.request_state import finish_reason
from services.engine.request_stream import ExportHook, RequestStream
from services.engine.requests import check_prompt
from services.engine.sampling import Sampler, SamplingParams
from services.engine.scheduler import RequestTooLarge, Scheduler, SchedulerConfig, SchedulerOutput, Sequence
from services.engine.step_results import logprobs_asked, take_device_logprobs, take_logits
from services.errors import Cancelled, EngineStepFailed, InvalidRequest, PromptTooLong, QueueFull, ShuttingDown

log = logging.getLogger(__name__)


class EngineLoop:
    """Owns `engine` from its own thread; see the module docstring."""

    def __init__(self, engine: BatchEngine, config: SchedulerConfig, eos_token_ids: tuple[int, ...] = (),
                 max_waiting: int = 64, name: str = "engine-loop", grammars: GrammarTokenizer | None = None):
        # back-pressure: at most max_num_seqs running and max_waiting more queued behind them
        self.engine, self.config, self.eos_token_ids = engine, config, frozenset(eos_token_ids)
        self.grammars = grammars  # structured outputs; None: requests with a grammar are refused
        self.max_waiting = max_waiting
        self.scheduler = Scheduler(config)
        if config.host_kv_cache_mb and config.enable_prefix_caching:
            self.scheduler.block_manager.host_tier = HostKVTier(engine, config.host_kv_cache_mb << 20,
                                                                config.block_size)
        self._ids = itertools.count(1)
        self._inbox: list[tuple] = []
        self._wake = threading.Condition()
        self._streams: dict[int, RequestStream] = {}
        self._remote_pending: list[RequestStream] = []  # reserve_remote waiting for blocks
        self._n_live = 0  # streams submitted and not yet ended
        self._closed = False
        self._counted = (0, 0)  # prefix-cache tokens (queried, hit) already in the counters
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- what handlers call (any thread) ------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, export: ExportHook | None = None,
               bounded_elsewhere: bool = False, choice: int = 0) -> RequestStream:
        """Queue a request; its stream. Raises InvalidRequest/PromptTooLong at once, QueueFull when
        max_num_seqs + max_waiting requests are already running or waiting (unless
        `bounded_elsewhere`: an admission of the caller's own bounds such requests, e.g. hand-off
        prefills, which must not be refused because generations fill the queue)."""
        stream = self._new_stream(prompt_ids, params, export, counted=not bounded_elsewhere, computes_prompt=True,
                                  choice=choice)
        self._post(("add", stream))
        return stream

    def peek_cached_tokens(self, prompt_ids: list[int]) -> int:
        """How many leading positions of `prompt_ids` the prefix cache holds now, taking nothing.
        Read from the caller's thread without the loop (plain dict lookups under the GIL): a hint,
        which `reserve_remote` later confirms or finds evicted."""
        try:  # the host tier's blocks too: reserve_remote loads them back instead of a hand-off
            return self.scheduler.block_manager.cached_prefix_tokens(prompt_ids, with_host_tier=True)
        except (KeyError, IndexError, RuntimeError):  # changed under our feet: no hint
            return 0

    def reserve_remote(self, prompt_ids: list[int], params: SamplingParams,
                       max_cached_tokens: int | None = None) -> RequestStream:
        """Hybrid: a stream whose prompt KV the caller imports into `stream.wait_reserved(...)`'s blocks,
        taking at most `max_cached_tokens` positions from the prefix cache (`stream.seq.num_cached_tokens`
        says how many it got)."""
        stream = self._new_stream(prompt_ids, params, None)
        stream.max_cached_tokens = max_cached_tokens
        self._post(("reserve", stream))
        return stream

    def activate_remote(self, stream: RequestStream, first_token: int, logprob: TokenLogprob | None = None,
                        prompt_logprobs: tuple[TokenLogprob, ...] | None = None) -> None:
        """The reserved blocks hold the prompt's KV: decode on from `first_token` (its logprob and the
        prompt's, when asked for, come from the engine that prefilled)."""
        self._post(("activate", stream, first_token, logprob, prompt_logprobs))

    def reset_prefix_cache(self, timeout: float = 5.0) -> int:
        """Forget every cached block no request holds (between two steps); how many were forgotten."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._post(("reset_prefix_cache", done))
        return done.get(timeout=timeout)

    def close(self, timeout: float = 5.0) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for blocks or a place in the batch, hybrid ones waiting for blocks included."""
        return self.scheduler.num_waiting + len(self._remote_pending)

    # ---- internals ----------------------------------------------------------------------------
    def _new_stream(self, prompt_ids: list[int], params: SamplingParams, export: ExportHook | None,
                    counted: bool = True, computes_prompt: bool = False, choice: int = 0) -> RequestStream:
        if self._closed:
            raise ShuttingDown("the engine is shutting down")
        check_prompt(prompt_ids, self.engine.cfg.vocab_size, self.config.max_model_len)
        stop = (frozenset() if params.ignore_eos else self.eos_token_ids) | frozenset(params.stop_token_ids)
        seq = Sequence(next(self._ids), list(prompt_ids), params.max_tokens, stop, params,
                       all_logits=params.prompt_logprobs is not None and computes_prompt)
        stream = RequestStream(self, seq, Sampler(params, stream=choice, grammar=self._matcher(params, prompt_ids)),
                               export)
        if counted:
            with self._wake:
                if self._n_live >= self.config.max_num_seqs + self.max_waiting:
                    raise QueueFull(f"engine queue full ({self.config.max_num_seqs} running, {self.max_waiting} "
                                    f"waiting); retry later")
                self._n_live += 1
            stream._counted = True
        return stream

    def _matcher(self, params: SamplingParams, prompt_ids: list[int]) -> GrammarMatcher | None:
        """The request's grammar matcher, on the caller's thread (the tokenizer's first load, the grammar's
        compile and its first mask stay off the loop), past the output an earlier call produced."""
        if not params.grammar:
            return None
        if self.grammars is None:
            raise InvalidRequest("this engine serves no structured outputs (it was started without a tokenizer)")
        prior = prompt_ids[len(prompt_ids) - params.prior_output_tokens:] if params.prior_output_tokens else ()
        return self.grammars.matcher(params.grammar, prior)

    def _post(self, item: tuple) -> None:
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and not self._closed and not self._has_work():
                    self._wake.wait()
                if self._closed:
                    break
                inbox, self._inbox = self._inbox, []
            for item in inbox:
                self._apply(item)
            self._reserve_pending()
            out = self.scheduler.schedule()
            if out.is_empty:
                self.scheduler.update(out, {})
                self._update_gauges()
                with self._wake:  # only reservations or blocked admissions: wait for a change
                    if not self._inbox and not self._closed:
                        self._wake.wait(0.01)
                continue
            self._step(out)
        for stream in list(self._streams.values()) + self._remote_pending:
            stream._fail(ShuttingDown("the engine is shutting down"))

    def _has_work(self) -> bool:
        return self.scheduler.has_unfinished() and bool(self.scheduler.running or self.scheduler.waiting)

    def _apply(self, item: tuple) -> None:
        if item[0] == "reset_prefix_cache":
            reply: queue.SimpleQueue = item[1]
            reply.put(self.scheduler.block_manager.reset_prefix_cache())
            return
        kind, stream = item[0], item[1]
        if kind == "add":
            try:
                self.scheduler.add(stream.seq)
            except RequestTooLarge as exc:
                stream._fail(PromptTooLong(str(exc)))
                return
            self._streams[stream.seq_id] = stream
        elif kind == "reserve":
            self._remote_pending.append(stream)
        elif kind == "activate":
            self._activate(stream, *item[2:])
        elif kind == "abort":
            self._abort(stream)

    def _abort(self, stream: RequestStream) -> None:
        if stream in self._remote_pending:
            self._remote_pending.remove(stream)
        elif self._streams.pop(stream.seq_id, None) is not None:
            self.scheduler.abort(stream.seq_id)
        self._release(stream)
        stream.done = True
        stream._reserved.set()
        stream._events.put(("error", Cancelled("cancelled"), None))

    def _reserve_pending(self) -> None:
        while self._remote_pending:
            stream = self._remote_pending[0]
            try:
                table = self.scheduler.reserve_remote(stream.seq, stream.max_cached_tokens)
            except RequestTooLarge as exc:
                self._remote_pending.pop(0)
                stream._fail(PromptTooLong(str(exc)))
                continue
            if table is None:
                return  # first come, first served
            self._remote_pending.pop(0)
            self._streams[stream.seq_id] = stream
            stream.block_table = tuple(table)
            stream.timings.scheduled_at = time.perf_counter()
            stream._reserved.set()

    def _activate(self, stream: RequestStream, first_token: int, logprob, prompt_logprobs) -> None:
        if self._streams.get(stream.seq_id) is not stream:
            return  # cancelled meanwhile
        grammar = stream.sampler.grammar
        if grammar is not None:  # the engine that prefilled picked it under the same grammar
            grammar.accept(first_token)
            stream.seq.stop_requested = grammar.stopped
        seq = self.scheduler.activate_remote(stream.seq_id, first_token)
        if grammar is not None and not seq.status.finished:
            grammar.prepare()
        self._emit(stream, seq, first_token, logprob, prompt_logprobs)

    def _step(self, out: SchedulerOutput) -> None:
        now = time.perf_counter()
        for chunk in out.prefills:
            stream = self._streams.get(chunk.seq_id)
            if stream is not None and stream.timings.scheduled_at is None:
                stream.timings.scheduled_at = now
        sampling = [c for c in out.chunks if c.samples]
        # the device's argmax serves only when no row needs its logits (processing, logprobs, sampling)
        greedy = (all(c.sampling_params.device_greedy for c in sampling)
                  and not any(c.all_logits for c in out.chunks))
        # an engine with logprobs_on_device (the OpenCL engine's step(logprobs=...)) computes the logprobs
        # of a step whose sampling rows are all plain greedy; any other step reads every logit row back
        asked = None
        verifying = [c for c in out.decodes if c.num_drafts]  # their rows are picked on the host, in turn
        if (not greedy and not verifying and getattr(self.engine, "logprobs_on_device", False)
                and all(c.sampling_params.plain_greedy for c in sampling)):
            asked = logprobs_asked(out.chunks, self._streams)
        exporting = [(c, self._streams[c.seq_id]) for c in out.prefills
                     if c.samples and c.seq_id in self._streams and self._streams[c.seq_id].export is not None]
        try:
            on_layer = self._exporter(exporting) if exporting else None
            result = (self.engine.step(out.chunks, greedy, on_layer) if asked is None
                      else self.engine.step(out.chunks, True, on_layer, logprobs=asked))
        except Exception:
            log.exception("engine step failed (%d sequences, %d tokens); failing its requests",
                          len(out.chunks), out.num_batched_tokens)
            for chunk in out.chunks:
                stream = self._streams.pop(chunk.seq_id, None)
                if stream is not None:
                    self.scheduler.abort(chunk.seq_id)
                    stream._fail(EngineStepFailed("the engine failed while serving the request"))
            self.scheduler.update(out, {})
            return
        self.steps += 1
        ended = time.perf_counter()
        seconds = ended - now
        if token_trace.ON:
            token_trace.step(now, ended, len(out.chunks))
        m.STEP_SECONDS.observe(seconds)
        self.scheduler.observe_step(out, seconds)
        m.STEP_SEQUENCES.observe(len(out.chunks))
        m.STEP_TOKENS.observe(out.num_batched_tokens)
        if out.preempted:
            m.NUM_PREEMPTIONS.inc(len(out.preempted))
        logprobs: dict[int, TokenLogprob | None] = {}
        if greedy:
            sampled = dict(zip((c.seq_id for c in sampling), (int(t) for t in result)))
        elif asked is not None:
            sampled = take_device_logprobs(out, result, logprobs, self._streams)
        else:
            sampled = take_logits(out, result, logprobs, self._streams)
        self.scheduler.update(out, sampled)
        if verifying:
            _count_verified(verifying, sampled)
        grammars = []  # of the streams that go on: their next masks are computed while the next step runs
        for chunk in sampling:
            stream = self._streams.get(chunk.seq_id)
            if stream is not None and not stream.done:
                first = stream.timings.tokens == 0
                if chunk.num_drafts:  # the tokens the sequence took of those verified (it may have ended)
                    taken = stream.seq.num_tokens - chunk.start - 1
                    stream.timings.draft_tokens += chunk.num_drafts
                    stream.timings.accepted_draft_tokens += len(sampled[chunk.seq_id]) - 1
                    for i, token in enumerate(sampled[chunk.seq_id][:taken]):
                        self._emit(stream, stream.seq, token, logprobs[chunk.seq_id][i], None, ended,
                                   last=i == taken - 1)
                else:
                    self._emit(stream, stream.seq, sampled[chunk.seq_id], logprobs.get(chunk.seq_id),
                               stream.prompt_logprobs() if first else None, ended)
                stream.seq.all_logits = False  # a recompute after a preemption needs no prompt logits
                if stream.sampler.grammar is not None and not stream.done:
                    grammars.append(stream.sampler.grammar)
        if grammars:
            prepare_masks(grammars)
        self._update_gauges()

    def _exporter(self, exporting: list) -> Callable[[int], None]:
        def on_layer(layer: int) -> None:
            for chunk, stream in exporting:
                if stream.done:
                    continue
                try:
                    stream.export(layer, chunk.block_table, chunk.start + chunk.num_tokens)
                except Exception as exc:  # a gone client, a closed sender: that request only
                    log.debug("export of sequence %d stopped: %s", chunk.seq_id, exc)
                    self._streams.pop(chunk.seq_id, None)
                    self.scheduler.abort(chunk.seq_id)
                    stream._fail(Cancelled("the hand-off stopped"))
        return on_layer

    def _emit(self, stream: RequestStream, seq: Sequence, token: int, logprob: TokenLogprob | None = None,
              prompt_logprobs: tuple[TokenLogprob, ...] | None = None, at: float | None = None,
              last: bool = True) -> None:
        """`last`: the step's last token of this stream (a verify chunk emits several; only the last
        can carry the finish)."""
        t = stream.timings
        t.last_token_at = at = at or time.perf_counter()
        t.first_token_at = t.first_token_at or t.last_token_at
        t.tokens += 1
        if last and seq.status.finished:
            stream.done = True
            self._release(stream)
            self._streams.pop(stream.seq_id, None)
            stream._emit(token, finish_reason(seq.status), logprob, prompt_logprobs, at)
        else:
            stream._emit(token, None, logprob, prompt_logprobs, at)

    def _release(self, stream: RequestStream) -> None:
        """The stream has ended (finished, failed, cancelled): it no longer counts against the limit."""
        with self._wake:
            if stream._counted:
                stream._counted = False
                self._n_live -= 1

    def _update_gauges(self) -> None:
        s, bm = self.scheduler, self.scheduler.block_manager
        m.NUM_REQUESTS_RUNNING.set(s.num_running)
        m.NUM_REQUESTS_WAITING.set(self.num_waiting)
        m.STEP_TARGET.set(s.pacer.step_target_s)
        m.STEP_PROMPT_CAP.set(s.pacer.last_cap)
        m.KV_CACHE_USAGE.set(s.kv_cache_usage)
        m.PREFIX_CACHE_QUERIES.inc(bm.num_queried_tokens - self._counted[0])
        m.PREFIX_CACHE_HITS.inc(bm.num_hit_tokens - self._counted[1])
        self._counted = (bm.num_queried_tokens, bm.num_hit_tokens)


def _count_verified(chunks, sampled) -> None:
    """Speculation's counters for a step's verify chunks (vLLM's spec_decode names)."""
    m.SPEC_STEPS.inc()
    for c in chunks:
        emitted = len(sampled.get(c.seq_id) or ())
        m.SPEC_DRAFTS.inc()
        m.SPEC_DRAFT_TOKENS.inc(c.num_drafts)
        m.SPEC_ACCEPTED_TOKENS.inc(max(0, emitted - 1))
        m.SPEC_ACCEPTED_LENGTH.observe(emitted)
