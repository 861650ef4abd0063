"""Speculative decoding with n-gram drafts, the engine-neutral part: who drafts, and how a step's rows verify.

A decoding sequence normally computes one row a step: its newest token, whose logits give the next.
With drafts d1..dk from the n-gram proposer (ngram_proposer.py), its chunk is the newest token and the
drafts, k + 1 rows with causal attention over the paged KV (the shape of a prompt chunk, so both
engines run it as they run prefill), and every row's logits come back. Row i's logits are the target
model's next-token distribution after the newest token and d1..di. `verify` then picks, row by row,
with the request's own sampler, exactly as decoding one token at a time would (same controls, same
grammar mask, the same uniform draw keyed by the position): it keeps going while the pick equals the
draft. So the emitted tokens are the tokens speculation off would emit, greedy or seeded, and a pick
at temperature > 0 accepts a draft with the target's probability of it and, on a rejection, is a
draw from the target's distribution given that the draft was not drawn: the rule that keeps the
target's distribution for a deterministic proposer. The rejected drafts' KV past the kept positions is
cut back (BlockManager.truncate).

When it pays: at small batches, where a step reads every weight for few rows, k more rows of a
sequence cost little; in a large batch they cost arithmetic every row pays, and only drafts that are
mostly accepted repay it. So once more than `max_batch` decode together a sequence drafts only from a
match of the whole n_max tokens (on copy-heavy prompts 95% of such drafts were accepted, ~50% of those
from 2-4 tokens), and none drafts beyond `max_batch_long`; a request proposes fewer drafts after a
rejection and backs off while they keep failing (`Acceptance`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from services.engine.ngram_proposer import Acceptance, NgramConfig, NgramIndex


@dataclass(frozen=True)
class SpeculationConfig:
    k: int = 0  # drafts a sequence proposes a step at most; 0: speculation off
    n_min: int = 2
    n_max: int = 8  # BatchingSettings' default (why: there)
    max_batch: int = 2  # no drafts in a step with more sequences decoding than this...
    max_batch_long: int = 8  # ...but those of a match of n_max tokens, up to this many decoding

    @property
    def batch_limit(self) -> int:
        """The most sequences decoding at which any sequence may draft."""
        return max(self.max_batch, self.max_batch_long)

    @property
    def on(self) -> bool:
        return self.k > 0


@dataclass
class _State:
    index: NgramIndex
    acceptance: Acceptance = field(default_factory=Acceptance)


class Speculator:
    """Each decoding sequence's n-gram index and back-off; the drafts it proposes this step."""

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self._ngrams = NgramConfig(config.n_min, config.n_max, max(1, config.k))
        self._states: dict[int, _State] = {}

    def drafts(self, seq_id: int, token_ids: Sequence[int], room: int, n_decoding: int,
               wanted: bool = True) -> list[int]:
        """Up to min(k, room) draft tokens for a sequence of `token_ids` (prompt + output so far), decoding
        beside `n_decoding - 1` others; [] when speculation is off, the batch is too large, the request
        turned it off (`wanted`), or its back-off holds."""
        if not self.config.on or not wanted or room <= 0 or n_decoding > self.config.batch_limit:
            return []
        state = self._states.get(seq_id)
        if state is None:
            state = self._states[seq_id] = _State(NgramIndex(self._ngrams))
        seen = len(state.index.tokens)
        if seen > len(token_ids):  # cut back below what was indexed (a preemption recomputes): start over
            state.index, seen = NgramIndex(self._ngrams), 0
        state.index.extend(token_ids[seen:])
        if n_decoding > self.config.max_batch and state.index.match_length() < self._ngrams.n_max:
            return []  # in a larger batch only a long match's drafts (mostly accepted) pay for their rows
        if not state.acceptance.wants_drafts():
            return []
        return state.index.propose(state.acceptance.length(min(self.config.k, room)))

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        state = self._states.get(seq_id)
        if state is not None:
            state.acceptance.observe(proposed, accepted)

    def forget(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)


def verify(drafts: Sequence[int], pick: Callable[[int], int], stops: Callable[[int], bool]) -> list[int]:
    """The tokens a verify chunk emits: `pick(i)` is the request's own pick from row i (after the newest
    token and drafts[:i], the sampler seeing the tokens picked before it), and picking goes on while it
    equals the draft. The last token is the target's own: at the first disagreement, or after every
    draft was accepted (the last row's pick). A token that ends the sequence (`stops`) ends it there."""
    out: list[int] = []
    for i in range(len(drafts) + 1):
        token = pick(i)
        out.append(token)
        if i == len(drafts) or token != drafts[i] or stops(token):
            break
    return out
