"""Sampling parameters and the host-side sampler shared by every engine.

Both engines hand float32 logits (or, for plain greedy on the device, a token id) to
the same code, so a seed gives the same tokens whichever engine ran the model. A request
whose controls change the logits (penalties, logit_bias, min_tokens: logits_processing.py)
or that asks for logprobs (logprobs.py) takes the logits path even when greedy.
"""
from __future__ import annotations

import hashlib
import secrets
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from services.engine.logits_processing import process, processes
from services.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprob

if TYPE_CHECKING:
    from services.engine.grammar import GrammarMatcher


MAX_CHOICES = 16  # choices (n, best_of) of one request


@dataclass(frozen=True)
class SamplingParams:
    """Defaults follow OpenAI's: temperature 1, top_p 1; top_k 0 means off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # each generated token's logprob and this many alternatives; None: none
    prompt_logprobs: int | None = None  # the same for the prompt's positions 1..n-1 (echo)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 (or 0, the wire's unset) = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), as logits_processing.py adds them
    min_tokens: int = 0
    n: int = 1  # choices: the engine runtime fans the request out (services/engine/runtime.py)
    prior_output_tokens: int = 0  # the prompt's last tokens that are the request's output (a migration's)
    grammar: str = ""  # structured output: an llguidance grammar the tokens must follow (grammar.py); '' = none
    first_choice: int = 0  # the choice index of this request's choice 0 (a migrated choice's): its random stream
    speculative: bool = True  # drafts may be verified for it when the engine speculates (speculation.py)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty < 0 or not np.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.prior_output_tokens < 0:
            raise ValueError(f"prior_output_tokens must be >= 0, got {self.prior_output_tokens}")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {self.n}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not 0 <= self.first_choice < MAX_CHOICES:
            raise ValueError(f"first_choice must be in [0, {MAX_CHOICES}), got {self.first_choice}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy and nothing changes the logits (no controls, no grammar): the device's argmax is the pick,
        and an engine that computes logprobs on its device may give them too (engine_loop.py)."""
        return self.greedy and not processes(self) and not self.grammar

    @property
    def device_greedy(self) -> bool:
        """The device's argmax is the whole answer: plain greedy, no logprobs."""
        return self.plain_greedy and self.logprobs is None


def uniform(seed: int, stream: int, position: int) -> float:
    """The random number in [0, 1) of the token at `position` of a request's choice `stream`: a hash
    of the three, so it does not depend on which engine samples, what ran before, or where a
    migration cut the request (its continuation samples the same positions)."""
    digest = hashlib.blake2b(struct.pack("<QQQ", seed, stream, position), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0 ** -53


class Sampler:
    """Picks the next token from one sequence's logits. Its randomness is keyed by the request's seed
    (a fresh one when it has none), the choice (`stream`, for n > 1) and the token's position."""

    def __init__(self, params: SamplingParams, stream: int = 0, grammar: GrammarMatcher | None = None):
        # `stream`: the choice within this request; a migrated choice's request says which it was
        self.params, self.stream, self.grammar = params, params.first_choice + stream, grammar
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)

    def pick(self, logits: np.ndarray, token_ids: Sequence[int], num_prompt: int,
             stop_ids: frozenset[int]) -> tuple[int, TokenLogprob | None]:
        """The next token of a sequence of `token_ids` (the prompt's `num_prompt`, then its output) from
        its raw logits [vocab], after its controls (logits_processing.py) and its grammar's mask (grammar.py),
        and its logprob when asked for (of the raw logits). The grammar accepts the token."""
        p = self.params
        if processes(p):  # a continuation's earlier output counts as output
            row = process(logits, p, token_ids, max(0, num_prompt - p.prior_output_tokens), stop_ids)
        else:
            row = logits
        if self.grammar is not None:
            row = self.grammar.apply(row)
        token = self.sample(row, position=len(token_ids))
        if self.grammar is not None:
            self.grammar.accept(token)
        return token, (token_logprob(logits, token, p.logprobs) if p.logprobs is not None else None)

    def sample(self, logits: np.ndarray, position: int) -> int:
        """logits: [vocab] float32; `position`: of the token sampled (it keys the draw)."""
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < scaled.size:
            kth = np.partition(scaled, -p.top_k)[-p.top_k]
            scaled = np.where(scaled < kth, -np.inf, scaled)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = order[: int(np.searchsorted(cumulative, p.top_p)) + 1]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        # one uniform per token, keyed by its position: inverse CDF over the kept mass
        cdf = np.cumsum(probs)
        u = uniform(self.seed, self.stream, position)
        return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), probs.size - 1))
