"""What a request's sampling controls do to one row of logits before a token is picked.

One definition for both engines (the engine loop calls it on each sampling row), so a penalized
greedy request gives the same tokens in every mode, and a row's result depends on its own
sequence only (batch invariant). In order, as vLLM applies them:

    logit_bias          logits[t] += bias[t]
    min_tokens          EOS and the stop tokens get -inf until `min_tokens` tokens are out
    repetition_penalty  (vLLM's extension) a token seen in the prompt or the output so far:
                        logit / p if the logit is positive, else logit * p
    frequency_penalty   (OpenAI) logits[t] -= count of t in the output so far * frequency_penalty
    presence_penalty    (OpenAI) logits[t] -= presence_penalty if t is in the output so far
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def processes(params) -> bool:
    """Whether `params` change the logits at all (if not, the row is used as the engine gave it)."""
    return bool(params.logit_bias or params.min_tokens or params.frequency_penalty or params.presence_penalty
                or params.repetition_penalty not in (0.0, 1.0))


def process(logits: np.ndarray, params, token_ids: Sequence[int], num_prompt: int,
            stop_ids: frozenset[int]) -> np.ndarray:
    """The row [vocab] to pick from, for a sequence of `token_ids` (prompt of `num_prompt`, then the
    output so far) whose finishing tokens are `stop_ids`. A new array; `logits` is not changed."""
    out = logits.astype(np.float32, copy=True)
    vocab = out.size
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), np.int64)
        keep = ids < vocab  # ids past the vocabulary bias nothing
        np.add.at(out, ids[keep], np.fromiter((b for _, b in params.logit_bias), np.float32)[keep])
    generated = np.asarray(token_ids[num_prompt:], np.int64)
    if params.min_tokens and generated.size < params.min_tokens and stop_ids:
        stops = np.fromiter(stop_ids, np.int64)
        out[stops[stops < vocab]] = -np.inf
    if params.repetition_penalty not in (0.0, 1.0):
        seen = np.unique(np.asarray(token_ids, np.int64))
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if generated.size and (params.frequency_penalty or params.presence_penalty):
        ids, counts = np.unique(generated, return_counts=True)
        out[ids] -= (counts * params.frequency_penalty + params.presence_penalty).astype(np.float32)
    return out
