"""Draft tokens for speculative decoding from the request's own text: no second model.

When the output repeats something earlier in the prompt or the output (a rewrite, an edit of code, a
quoted document, an agent echoing tool output), the tokens that followed the last occurrence of the
sequence's latest n tokens are a good guess of what comes next. The proposer keeps, per sequence, an
index from each n-gram (n from `n_min` to `n_max`) to where it last ended, updated as tokens are
appended, so a proposal is a few dict lookups whatever the length: the longest n with an earlier
occurrence wins, and up to `k` tokens that followed it are the drafts.

A proposal is only a guess: the engine verifies every draft in one step (the target model's own choice
at each position, speculative_verify.py), so what the proposer says never changes the output, only how
many tokens a step yields. Per request it backs off while its drafts keep being rejected (`Acceptance`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class NgramConfig:
    n_min: int = 2  # the shortest n-gram matched: 1 matches any repeated token, and guesses too often
    n_max: int = 8  # the longest, tried first: a longer match tells apart the places a short phrase recurs
    k: int = 4  # drafts proposed at most

    def __post_init__(self):
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")
        if self.k < 1:
            raise ValueError(f"k must be at least 1, got {self.k}")


@dataclass
class NgramIndex:
    """One sequence's tokens and, per n, where each n-gram last ended before the newest token."""

    config: NgramConfig
    tokens: list[int] = field(default_factory=list)
    _last_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end position (inclusive)
    _previous: dict[int, int] = field(default_factory=dict)  # n -> earlier end of the current suffix n-gram

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens (the prompt at first, then each accepted output token)."""
        for t in new_tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1
            for n in range(self.config.n_min, self.config.n_max + 1):
                if end + 1 < n:
                    self._previous.pop(n, None)
                    continue
                key = tuple(self.tokens[end + 1 - n:end + 1])
                earlier = self._last_end.get(key)
                if earlier is None:
                    self._previous.pop(n, None)
                else:
                    self._previous[n] = earlier
                self._last_end[key] = end

    def match_length(self) -> int:
        """The longest n whose suffix n-gram occurred before (what `propose` would draft from); 0: none."""
        for n in range(self.config.n_max, self.config.n_min - 1, -1):
            if self._previous.get(n) is not None:
                return n
        return 0

    def propose(self, k: int | None = None) -> list[int]:
        """Up to `k` (default: the config's) tokens that followed the latest earlier occurrence of the
        longest suffix n-gram seen before; [] when none was."""
        k = self.config.k if k is None else k
        n = self.match_length()
        if k <= 0 or n == 0:
            return []
        earlier = self._previous[n]
        return self.tokens[earlier + 1:earlier + 1 + k]


@dataclass
class Acceptance:
    """Backs a request's speculation off while its drafts are rejected, and tries again later.

    How many drafts: after a verify step that accepted all it proposed, up to twice as many next time;
    after one that rejected some, one more than it accepted (a mostly wrong guesser checks one or two
    rows a step, not k). Whether to draft at all: after `patience` verify steps in a row that accepted
    nothing, nothing for `pause` steps, the pause doubling each time it happens again (up to
    `max_pause`); a step that accepts a draft resets it."""

    patience: int = 2
    pause: int = 8
    max_pause: int = 256
    _misses: int = 0
    _paused_for: int = 0
    _next_pause: int = 0
    _length: int | None = None  # the drafts the next proposal may have (None: as many as asked)

    def length(self, most: int) -> int:
        """How many drafts to propose, of at most `most`."""
        return most if self._length is None else min(most, self._length)

    def wants_drafts(self) -> bool:
        if self._paused_for > 0:
            self._paused_for -= 1
            return False
        return True

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self._length = 2 * proposed if accepted == proposed else accepted + 1
        if accepted > 0:
            self._misses, self._next_pause = 0, 0
            return
        self._misses += 1
        if self._misses >= self.patience:
            self._next_pause = min(self.max_pause, max(self.pause, 2 * self._next_pause))
            self._paused_for, self._misses = self._next_pause, 0
