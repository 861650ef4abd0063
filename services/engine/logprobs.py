"""Log-probabilities of one position, from the fp32 logits an engine already computed.

Both engines hand the same function a row of logits, so every mode reports the same numbers (and
they are what `transformers`' log_softmax gives, to fp32 round-off). Only k + 1 numbers per
position leave the engine: the chosen token's logprob and the k most likely tokens', never the
vocabulary. The values are the model's own distribution (the raw logits' log-softmax), before
penalties, biases and temperature, as OpenAI and vLLM's default report them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs; the gateway refuses more


@dataclass(frozen=True)
class TokenLogprob:
    """One position: its token's logprob and the `top` most likely (token id, logprob), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax_lse(logits: np.ndarray) -> float:
    """log(sum(exp(logits))) of one row, stable (max subtracted, summed in float64)."""
    peak = float(logits.max())
    # exp in fp32 (each term is in [0, 1], exact to 1 ulp), summed in fp64: ~3x faster than exp in fp64
    return peak + float(np.log(np.exp(logits - np.float32(peak)).sum(dtype=np.float64)))


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """`token`'s logprob under `logits` [vocab] and the k most likely tokens' (ties: lower id first)."""
    lse = log_softmax_lse(logits)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, logits.size)
        # the k-th largest logit; every id above it, then the lowest ids equal to it (argpartition alone
        # would take any of the tied ones: a row of ties across the k-th place would name ids at random)
        kth = np.partition(logits, logits.size - k)[logits.size - k]
        above = np.flatnonzero(logits > kth)
        ids = np.concatenate([above, np.flatnonzero(logits == kth)[:k - above.size]])
        ids = ids[np.lexsort((ids, -logits[ids]))]  # by logit, then by id
        top = tuple((int(i), float(logits[i]) - lse) for i in ids)
    return TokenLogprob(float(logits[token]) - lse, top)


def prompt_logprobs(logits: np.ndarray, prompt: list[int], k: int) -> list[TokenLogprob]:
    """Positions 1..n-1 of a prompt: row i of `logits` [n-1, vocab] predicts prompt[i + 1]."""
    return [token_logprob(row, prompt[i + 1], k) for i, row in enumerate(logits)]
