"""Sampling parameters and the host-side sampler shared by every engine.

Both engines hand float32 logits (or, for greedy on the device, a token id) to
the same code, so a seed gives the same tokens whichever engine ran the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Picks the next token from one sequence's logits; owns that sequence's RNG."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def advance(self) -> None:
        """Consume the randomness of one token sampled elsewhere (hybrid mode: the
        first token is sampled by prefill_gpu), so the stream continues as if here."""
        if not self.params.greedy:
            self._rng.random()

    def sample(self, logits: np.ndarray) -> int:
        # logits: [vocab] float32
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
        # exactly one uniform per token (see advance): inverse CDF over the kept mass
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"), probs.size - 1))
