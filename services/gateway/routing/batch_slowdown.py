"""What a request adds to a running batch: each decode engine's per-token slowdown with company.

With continuous batching a new request does not wait for the ones running: it joins their
batch, and each step then costs more. The decode time of a request that shares its engine
with `s` others is modelled as

    decode(s) = decode(alone) x (1 + beta x s)          beta >= 0, per engine

and beta is fitted online from the requests' own decode times, each tagged with the `s` the
router saw when it sent the request: the ratio r = measured / the alone-estimate is regressed
on s (r = c0 + c1 s, both >= 0; beta = c1 / c0). Until decodes at two different company
sizes have been seen, beta is 0 (alone-costs, as before batching). A slow request timed on
a busy machine and a truly slower batch look alike in one sample; the fit over a window of
them separates the trend in s from the noise.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from services.gateway.routing.cost_model import nnls

MIN_SAMPLES = 4  # decodes behind a fit
MAX_BETA = 4.0  # one more request can at most add this many alone-steps: a bound on a noisy fit


class BatchSlowdown:
    """beta for one engine, from (company, measured / alone-estimate) pairs."""

    def __init__(self, window: int = 64):
        self._points: deque[tuple[float, float]] = deque(maxlen=window)
        self.beta = 0.0

    def add(self, company: int, ratio: float) -> None:
        if company < 0 or not ratio > 0:
            return
        self._points.append((float(company), float(ratio)))
        self._refit()

    def factor(self, company: int) -> float:
        """decode(company) / decode(alone)."""
        return 1.0 + self.beta * max(0, company)

    @property
    def samples(self) -> int:
        return len(self._points)

    def _refit(self) -> None:
        s = np.array([p[0] for p in self._points])
        if len(s) < MIN_SAMPLES or len(set(s.tolist())) < 2:
            return
        r = np.array([p[1] for p in self._points])
        c0, c1 = nnls(np.stack([np.ones_like(s), s], axis=1), r)
        self.beta = 0.0 if c0 <= 0 else min(MAX_BETA, c1 / c0)
