"""Request handling both engine services share, in plain Python: a request in, token events out.

`EngineRuntime.generate(request, cancel)` admits the request (the engine loop's bounded queue), runs it
in the mode it asks for and yields `TokenEvent`s, the last one with its
finish_reason and timings. It raises the typed errors of services/errors.py and knows
nothing of gRPC: the servicer (service.py) is a thin layer over it, and in-process
callers (the profile sweep's hand-off samples, tests) call it directly.

Every request runs through the engine loop (engine_loop.py): one thread owns the engine
and batches every running request into each step. Each service's runtime subclasses this
one and fills `modes`: mode name → a handler `(request, timings, cancel) → TokenEvents`
(prefill and decode on this engine here; hybrid mode in decode_fpga/hybrid.py).
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Callable, Iterator

from services.engine import metrics as m
from services.engine.engine_loop import EngineLoop
from services.engine.token_event import TokenEvent
from services.engine.grammar import GrammarTokenizer
from services.engine.profile_cache import sweep_lock
from services.engine.profile_sweep import LoopTimer, Profile, code_fingerprint, profile_engine, run_sweep
from services.engine.request_stream import RequestStream
from services.engine.requests import Cancellation, EngineRequest, RequestTimings, check_prompt
from services.engine.scheduler import SchedulerConfig
from services.engine.speculation import SpeculationConfig
from services.errors import Cancelled, InvalidRequest, QueueFull

ModeHandler = Callable[[EngineRequest, RequestTimings, Cancellation], Iterator[TokenEvent]]


def scheduler_config(engine, settings, max_context: int) -> SchedulerConfig:
    """The scheduler over `engine`'s pool, with the service's batching settings."""
    return SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size,
                           max_num_seqs=settings.max_num_seqs,
                           # the engine is built for the stretched steps' rows; calm steps take the setting's
                           max_num_batched_tokens=min(settings.max_num_batched_tokens, engine.max_num_batched_tokens),
                           stretched_batched_tokens=engine.max_num_batched_tokens,
                           max_model_len=max_context, enable_prefix_caching=settings.enable_prefix_caching,
                           step_target_s=settings.step_target_s, ttft_target_s=settings.ttft_target_s,
                           step_max_s=settings.step_max_s, host_kv_cache_mb=settings.host_kv_cache_mb,
                           # what the engine's head holds beyond one row per sequence (prompt logprobs)
                           prompt_logit_rows=getattr(engine, "prompt_logit_rows", SchedulerConfig.prompt_logit_rows),
                           speculation=speculation_config(settings))


def speculation_config(settings) -> SpeculationConfig:
    """Speculative decoding from the service's batching settings (off unless speculative_k > 0)."""
    return SpeculationConfig(k=settings.speculative_k, n_min=settings.speculative_n_min,
                             n_max=max(settings.speculative_n_min, settings.speculative_n_max),
                             max_batch=settings.speculative_max_batch,
                             max_batch_long=settings.speculative_max_batch_long)


def grammar_tokenizer(loaded) -> GrammarTokenizer:
    """Structured outputs' view of the checkpoint's tokenizer, loaded at the first request with a grammar."""
    from services.model.tokenizer import load_tokenizer

    return GrammarTokenizer(lambda: load_tokenizer(loaded.checkpoint), loaded.config.vocab_size,
                            loaded.config.eos_token_ids)


class EngineRuntime:
    device_label = ""  # "gpu" | "fpga"
    engine_name = ""  # "torch" | "opencl"
    default_mode = ""  # the mode of a request that names none

    def __init__(self, engine, loaded, settings, max_context: int):
        self.engine, self.loaded, self.settings, self.max_context = engine, loaded, settings, max_context
        self.loop = EngineLoop(engine, scheduler_config(engine, settings, max_context),
                               loaded.config.eos_token_ids, max_waiting=settings.queue_depth,
                               name=f"{self.device_label}-engine-loop", grammars=grammar_tokenizer(loaded))
        self.modes: dict[str, ModeHandler] = {}
        self._profile: Profile | None = None
        self._profile_lock = threading.Lock()

    # ---- Generate -------------------------------------------------------------
    def generate(self, request: EngineRequest, cancel: Cancellation) -> Iterator[TokenEvent]:
        """Run one request. Raises InvalidRequest/PromptTooLong before it queues, QueueFull when the
        queue is full, Cancelled once `cancel` fires, and the mode's own typed errors."""
        if request.mode not in self.modes:
            raise InvalidRequest(f"{self.device_label} engine does not serve mode {request.mode}; "
                                 f"it serves {sorted(self.modes)}")
        check_prompt(request.prompt_ids, self.loaded.config.vocab_size, self.max_context)
        if request.params.grammar and self.loop.grammars is not None:
            # the tokenizer's first load (seconds) before anything is held: a hand-off's arena slot, blocks
            self.loop.grammars.get()
        status = "error"
        try:
            timings = RequestTimings(prompt_tokens=len(request.prompt_ids))
            if request.params.n == 1:
                events = self.modes[request.mode](request, timings, cancel)
            else:
                events = self._choices(request, timings, cancel)
            try:
                n, finished = 0, 0
                for ev in events:
                    n += 1
                    if ev.finish_reason is None:
                        yield ev
                        continue
                    finished += 1
                    timings.generated_tokens = n
                    if finished == request.params.n:
                        self.observe(request.mode, timings)
                        status = "ok"
                    yield dataclasses.replace(ev, timings=timings)
            finally:
                events.close()
        except QueueFull:
            status = "rejected"
            raise
        except Cancelled:
            status = "cancelled"
            raise
        finally:
            if status == "error" and cancel.is_cancelled():
                status = "cancelled"
            m.REQUESTS.labels(status=status).inc()

    def _choices(self, request: EngineRequest, timings: RequestTimings,
                 cancel: Cancellation) -> Iterator[TokenEvent]:
        """The events of a request's n choices, merged (each with its `index`). Choice 0 runs in the
        request's mode and computes the prompt; once it has its first token, the prompt's full KV
        blocks are in this engine's prefix cache (in hybrid mode: imported), and choices 1..n-1 run
        here from them, computing only the prompt's last, partial block: one prefill, not n."""
        inner = Cancellation(cancel.deadline)  # ends every choice when the request ends, however
        cancel.add_callback(inner.cancel)
        merged: queue.SimpleQueue = queue.SimpleQueue()
        follower_params = dataclasses.replace(request.params, n=1, prompt_logprobs=None)

        def pump(index: int, events: Iterator[TokenEvent]) -> None:
            try:
                for ev in events:
                    merged.put(("event", dataclasses.replace(ev, index=index)))
                merged.put(("end", index))
            except BaseException as exc:
                merged.put(("error", exc))

        def start(index: int, events: Iterator[TokenEvent]) -> None:
            threading.Thread(target=pump, args=(index, events), name=f"choice-{index}", daemon=True).start()

        start(0, self.modes[request.mode](request, timings, inner))
        ended, forked = 0, False
        try:
            while ended < request.params.n:
                kind, payload = merged.get()
                if kind == "error":
                    raise payload
                if kind == "end":
                    ended += 1
                    continue
                if not forked:
                    forked = True
                    for index in range(1, request.params.n):
                        stream = self.loop.submit(list(request.prompt_ids), follower_params, bounded_elsewhere=True,
                                                  choice=index)
                        start(index, stream_tokens(stream, RequestTimings(), inner))
                yield dataclasses.replace(payload, more=not merged.empty())  # whichever choice it is of
        finally:
            inner.cancel()

    def local_generation(self, request: EngineRequest, timings: RequestTimings,
                         cancel: Cancellation) -> Iterator[TokenEvent]:
        """Prefill and decode on this engine, batched with every other running request."""
        stream = self.loop.submit(list(request.prompt_ids), request.params)
        return stream_tokens(stream, timings, cancel)

    def observe(self, mode: str, t: RequestTimings) -> None:
        m.STAGE_SECONDS.labels(stage="prefill", device="gpu" if mode in ("gpu", "hybrid") else "fpga").observe(
            t.prefill_s)
        m.STAGE_SECONDS.labels(stage="decode", device=self.device_label).observe(t.decode_s)

    # ---- Info / Profile ----------------------------------------------------------
    def info_fields(self) -> dict:
        cfg = self.loaded.config
        return dict(model_id=cfg.model_id, engine=self.engine_name, device=self.engine.device_name,
                    kv_layout="layer,kv,head,token,dim", max_context=self.max_context,
                    max_concurrency=self.settings.max_num_seqs, n_layers=cfg.n_layers,
                    n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                    **self.load_fields())

    def load_fields(self) -> dict:
        """The pool and the load right now, from the loop's scheduler (read without its lock: a
        snapshot a step old at worst, which is what a router polling every second needs)."""
        s = self.loop.scheduler
        return dict(max_num_seqs=s.config.max_num_seqs, block_size=s.config.block_size,
                    num_kv_blocks=s.config.num_blocks, num_requests_running=s.num_running,
                    num_requests_waiting=self.loop.num_waiting,
                    kv_cache_usage_ratio=s.kv_cache_usage)

    def profile_samples(self, refresh: bool = False) -> Profile:
        with self._profile_lock:
            if refresh:
                with sweep_lock(self.settings.profile_cache):  # the engines take turns timing
                    sweep = run_sweep(LoopTimer(self.loop), self.device_label)
                    self._profile = Profile(sweep, quiet=not sweep.busy)
            elif self._profile is None:
                # cached and checked by a quick probe, or measured in turn with the other engine
                self._profile = profile_engine(LoopTimer(self.loop), self.device_label, self.settings.profile_cache,
                                               self._profile_key(), self.settings.profile_attempts,
                                               self.settings.profile_keep_busy)
            return self._profile

    def _profile_key(self) -> str:
        """What the cached timings depend on: model, engine, device, storage format, code."""
        storage = getattr(self.engine, "weights_dtype", None) or str(getattr(self.engine, "kv_dtype", ""))
        return (f"{self.loaded.config.model_id}-{self.engine_name}-{self.engine.device_name}-{storage}-"
                f"{code_fingerprint()}")

    def close(self) -> None:
        """Let go of what the runtime holds beyond the engine (the loop, connections, mappings)."""
        self.loop.close()


def stream_tokens(stream: RequestStream, timings: RequestTimings, cancel: Cancellation) -> Iterator[TokenEvent]:
    """A loop stream's tokens until its finish (or `cancel`), with its stage times put into `timings`
    on the last one (added to what an earlier stage, e.g. a hybrid hand-off, put there)."""
    for ev in stream.events(cancelled=cancel.is_cancelled):
        if ev.finish_reason is not None:
            t = stream.timings
            timings.queue_s += t.queue_s
            timings.prefill_s = timings.prefill_s or t.prefill_s
            timings.decode_s = t.decode_s
            timings.cached_tokens = stream.seq.num_cached_tokens
            timings.draft_tokens += t.draft_tokens
            timings.accepted_draft_tokens += t.accepted_draft_tokens
        yield ev
