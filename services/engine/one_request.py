"""Requests on an engine without a server: an engine loop of its own over the engine's paged step.

The command line's `generate`, benchmarks and tests drive an engine this way, through the same
scheduler, engine loop and `step` a service runs (engine_loop.py), so what they check and time is
what serving does. `OneRequest` runs one request and closes its loop; `local_loop` gives the loop
itself, for several requests at once (a batch) or many in turn (a timing sweep).

Only one loop may drive an engine at a time: each loop's scheduler owns the engine's whole KV pool.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from services.engine.engine_loop import EngineLoop
from services.engine.request_stream import StreamTimings
from services.engine.requests import check_prompt
from services.engine.sampling import SamplingParams
from services.engine.scheduler_config import SchedulerConfig
from services.engine.token_event import TokenEvent

# a loop's close waits for the step in flight: the next loop on the engine must not start beside it
CLOSE_TIMEOUT_S = 120.0


def engine_context(engine) -> int:
    """The longest sequence the engine serves: its own cap (the OpenCL engine's max_context) or the model's."""
    return min(getattr(engine, "max_context", engine.cfg.max_context), engine.cfg.max_context)


def local_config(engine, max_context: int | None = None, max_num_seqs: int | None = None,
                 enable_prefix_caching: bool = False) -> SchedulerConfig:
    """A scheduler over the engine's whole pool and step. No prefix cache unless asked: a tool's
    repeated prompt is then computed again, as it was meant to be timed or checked."""
    seqs = max_num_seqs or getattr(engine, "max_num_seqs", 64)
    return SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size,
                           max_num_seqs=min(seqs, engine.max_num_batched_tokens),
                           max_num_batched_tokens=engine.max_num_batched_tokens,
                           max_model_len=max_context or engine_context(engine),
                           enable_prefix_caching=enable_prefix_caching,
                           prompt_logit_rows=getattr(engine, "prompt_logit_rows", SchedulerConfig.prompt_logit_rows))


@contextlib.contextmanager
def local_loop(engine, max_context: int | None = None, **config) -> Iterator[EngineLoop]:
    """An engine loop over `engine` (local_config's scheduler; config: its keywords), closed on exit.
    The model's EOS ids end a request unless it ignores them."""
    loop = EngineLoop(engine, local_config(engine, max_context, **config), engine.cfg.eos_token_ids,
                      name="local-engine-loop")
    try:
        yield loop
    finally:
        loop.close(CLOSE_TIMEOUT_S)


class OneRequest:
    """One request through a loop of its own: iterate for its TokenEvents (the last one has the
    finish_reason). Raises InvalidRequest / PromptTooLong when made, as a service would before it
    queues the request. `timings` (the stream's: prefill_s, decode_s, tokens) is final once
    iteration ends."""

    def __init__(self, engine, prompt_ids: list[int], params: SamplingParams, max_context: int | None = None):
        self.engine, self.prompt_ids, self.params = engine, list(prompt_ids), params
        self.max_context = max_context or engine_context(engine)
        check_prompt(self.prompt_ids, engine.cfg.vocab_size, self.max_context)
        self.timings: StreamTimings | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        with local_loop(self.engine, self.max_context, max_num_seqs=1) as loop:
            stream = loop.submit(self.prompt_ids, self.params)
            self.timings = stream.timings
            yield from stream


def greedy_tokens(engine, prompt_ids: list[int], n: int, max_context: int | None = None) -> list[int]:
    """n greedy tokens after the prompt (EOS ignored)."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [ev.token for ev in OneRequest(engine, prompt_ids, params, max_context)]
