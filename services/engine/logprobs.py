"""Log-probabilities of one position, from the fp32 logits an engine already computed.

Both engines hand the same function a row of logits, so every mode reports the same numbers (and
they are what `transformers`' log_softmax gives, to fp32 round-off). Only k + 1 numbers per
position leave the engine: the chosen token's logprob and the k most likely tokens', never the
vocabulary. The values are the model's own distribution (the raw logits' log-softmax), before
penalties, biases and temperature, as OpenAI and vLLM's default report them.

An engine that can compute them on its device (the OpenCL engine: kernels/logprobs.cl) is asked
with `LogprobsAsked` and answers `StepLogprobs`: the same numbers, read back as 2 + 2k words a row
instead of the row's logits, for rows nothing on the host has to change (plain greedy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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


@dataclass(frozen=True)
class LogprobsAsked:
    """What a step asks of an engine that computes logprobs on its device: for each logit row of the
    step (BatchEngine.step's rows, in order) the token whose logprob is wanted, -1 for the row's own
    argmax (a greedy pick), and the k most likely tokens of every row."""

    k: int
    targets: Sequence[int]

    def __post_init__(self) -> None:
        if not 0 <= self.k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"k must be in [0, {MAX_TOP_LOGPROBS}], got {self.k}")


@dataclass(frozen=True)
class StepLogprobs:
    """A step's answer to LogprobsAsked: per logit row its argmax, its target's logprob and its k best
    (ids [n, k], logprobs [n, k], best first, ties the lower id first)."""

    picks: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    @classmethod
    def from_words(cls, words: np.ndarray, k: int) -> "StepLogprobs":
        """From the device's int32 rows [n, 2 + 2k]: the pick, the target's logprob, k ids, k logprobs
        (the float values stored as their bits)."""
        words = np.ascontiguousarray(words, np.int32).reshape(-1, 2 + 2 * k)
        return cls(words[:, 0].copy(), words[:, 1].view(np.float32).copy(), words[:, 2:2 + k].copy(),
                   words[:, 2 + k:].copy().view(np.float32))

    def __len__(self) -> int:
        return len(self.picks)

    def at(self, row: int, k: int) -> TokenLogprob:
        """Row `row`'s TokenLogprob with its k best (k <= the step's k)."""
        if k > self.top_ids.shape[1]:
            raise ValueError(f"{k} top logprobs asked of a step that computed {self.top_ids.shape[1]}")
        ids, values = self.top_ids[row, :k].tolist(), self.top_logprobs[row, :k].tolist()
        return TokenLogprob(float(self.logprobs[row]), tuple(zip(ids, values)))
