"""Structured outputs in the engines: a grammar's token mask over a sequence's logits.

The gateway turns `response_format` into an llguidance grammar (services/gateway/protocol/structured.py) and
sends its text in `SamplingParams.grammar`. Each sequence that has one keeps a `GrammarMatcher`:

* before its token is picked, the tokens the grammar does not allow next get -inf in its fp32 row
  (host side, in the engine process, on the logits the engine read back: the same place the
  logprobs and penalties are computed, so every mode masks alike);
* the picked token advances the matcher; once the grammar is complete the sequence stops there;
* the mask of the next position is computed right after that accept, by one worker thread, while
  the engine runs the next step (`prepare_masks`); llguidance computes it with the GIL released,
  so the pick at the next step only waits for what is left of it.

llguidance was picked by measurement (bench/micro/grammar_libs.py): it builds its lexer lazily, so a
schema never seen before costs a request ~1-4 ms in all, where xgrammar and outlines-core compile
for 10-200 ms first; it has no dependencies of its own; it takes JSON schemas, regexes and Lark.
Its view of the tokenizer takes ~2 s to build (plus loading the tokenizer): done once per process,
at the first request with a grammar.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import llguidance
import llguidance.numpy as llg_np
import numpy as np

from services.errors import InvalidRequest

log = logging.getLogger(__name__)

# one thread: a step's masks are computed in turn (llguidance drops the GIL meanwhile); more would
# only take the cores the engine's step runs on
_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
_SAY = 400  # characters of llguidance's error to pass on (it appends its whole state and grammar)


class GrammarTokenizer:
    """The engine's tokenizer as llguidance sees it, built on first use (a grammar request)."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, eos_token_ids: Sequence[int]):
        self._load, self.vocab_size, self.eos_token_ids = load_tokenizer, vocab_size, list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def get(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf  # here, not at the top: it imports transformers (~1 s of every engine's start)

                hf = self._load()
                # the model's vocabulary may be larger than the tokenizer's (padding rows): those ids are
                # never allowed; EOS is what the engine stops on, so a complete grammar ends the sequence
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids or None)
            return self._tokenizer

    def matcher(self, grammar: str, prior_tokens: Sequence[int] = ()) -> "GrammarMatcher":
        """A matcher for `grammar` that has consumed `prior_tokens` (the output of an earlier call of the
        same request: a migration's, or the first token a hybrid hand-off brought); its first mask is
        computed here, on the caller's thread. InvalidRequest when the grammar does not compile."""
        return GrammarMatcher(self.get(), grammar, self.vocab_size, prior_tokens)


def check_grammar(grammar: str) -> str:
    """'' when `grammar` compiles, else the reason (without a tokenizer: what the gateway can check)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return "; ".join(messages) if is_error else ""


class GrammarMatcher:
    """One sequence's place in its grammar and the mask of its next token."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, vocab_size: int,
                 prior_tokens: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidRequest(f"the grammar does not compile: {self._matcher.get_error()[:_SAY]}")
        if prior_tokens and not self._matcher.consume_tokens(list(prior_tokens)):
            raise InvalidRequest(f"the output so far does not fit the grammar: {self._matcher.get_error()[:_SAY]}")
        self._bitmask = llg_np.allocate_token_bitmask(1, vocab_size)
        self._allowed = np.zeros(vocab_size, bool)
        self._pending: Future | None = None
        self._stale = True  # the mask is not yet the next position's
        self._fill()

    @property
    def stopped(self) -> bool:
        """The grammar is complete (or broken): nothing may follow."""
        return self._matcher.is_stopped() or self._matcher.is_error()

    def accept(self, token: int) -> None:
        """`token` was picked (under this matcher's mask, or by the engine that prefilled)."""
        self._wait()
        self._stale = True
        if not self._matcher.consume_token(token):
            # only a token the mask allowed gets here: a broken matcher ends the sequence (`stopped`)
            log.warning("grammar refused token %d: %s", token, self._matcher.get_error()[:_SAY])

    def prepare(self) -> Future:
        """Compute the next mask on the worker thread; `apply` waits for it."""
        self._pending = _WORKER.submit(self._fill)
        return self._pending

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next (do not change it)."""
        self._wait()
        if self._stale:  # nobody prepared it: fill it now
            self._fill()
        return self._allowed

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` [vocab] with every token the grammar does not allow next at -inf."""
        allowed = self.allowed()
        if logits.size > allowed.size:  # a head wider than the vocabulary: the extra ids are never allowed
            allowed = np.concatenate([allowed, np.zeros(logits.size - allowed.size, bool)])
        return np.where(allowed[:logits.size], logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def _fill(self) -> None:
        llg_np.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        # unpacked here, on the worker, so the pick only selects
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:self.vocab_size]
        self._allowed = bits.view(bool)
        self._stale = False

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def prepare_masks(matchers: Iterable[GrammarMatcher]) -> Future | None:
    """The next masks of a step's matchers, in one job on the worker thread (the engine loop calls it
    right after a step's tokens are accepted, so they are ready, or nearly, when the next step's logits
    are)."""
    batch = [m for m in matchers if not m.stopped]
    if not batch:
        return None

    def fill_all() -> None:
        for m in batch:
            m._fill()

    job = _WORKER.submit(fill_all)
    for m in batch:
        m._pending = job
    return job
