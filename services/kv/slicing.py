"""Token slice lengths for a prefill whose KV crosses a network: TeraPipe's dynamic program, two stages.

The prompt is prefilled in slices s_1 .. s_K (token counts summing to n). Slice i computes in
c_i = t(s_i, context before it) and then travels in d_i = latency + s_i * bytes_per_token / bandwidth;
the link sends slice i while the engine computes slice i + 1. With compute and link each doing one
thing at a time, in order, the last byte lands at

    T = max over j of ( c_1 + ... + c_j  +  d_j + ... + d_K )

(slice j is where the pipeline's critical path leaves the engine for the link). TeraPipe (Li et al.,
ICML 2021) picks slice lengths by a DP over the slices' positions; here the stages are the engine
and the link, so the DP is over (position p, slices left r):

    H(p, r) = min over s of  t(s, p) + max( r * latency + (n - p) * bytes_per_token / bandwidth,  H(p + s, r - 1) )

with H(n, 0) = -inf (no term left) and T_best = min over K of H(0, K). Exact for the model above:
T splits as c_1 + max(the term for j = 1, the terms for j > 1), and the latter are the same
problem on the rest of the prompt. With `layers` = L > 1 each slice streams layer by layer (part l
sent once computed), and slice j's own term becomes max(latency + c_j / L + b_j, c_j + b_j / L) + the
later slices' sends (b_j: its bytes' time; the latency rides with its first part), the rest unchanged.
Lengths are multiples of a granule (the engine's block size, say) so the DP stays small:
O((n / granule)^3) steps, pure Python. Every uniform slicing on that grid (size a multiple of the
granule, the last slice what is left) is one of the DP's candidates, and `best_slices` also scores
each of them with `pipeline_time` itself, so its answer is never predicted slower than any of them.

`PrefillCost` is t(slice length n, context before it) as a prefill physically costs:

    t(n, ctx) = a + b n + c n ctx + d n^2        (a, b, c, d >= 0)

a per step (launches, the sampler), b per token (the matmuls, the KV export), c per token and
context token (attention to the KV before the slice), d per token pair inside the slice (its own
causal attention, the score matrix's memory traffic). Fitted to points measured on the engine by
least squares on relative error with the coefficients kept non-negative, so it extrapolates to
slices longer than the ones measured the way attention grows, not along a straight line (a linear
extrapolation made long slices look cheap and the DP pick them).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Sequence

import numpy as np

ComputeCost = Callable[[int, int], float]  # (slice length, context before it) -> seconds


@dataclass(frozen=True)
class Link:
    bytes_per_s: float
    latency_s: float  # per message: one-way delay plus per-send overhead

    def send_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


def pipeline_time(slices: Sequence[int], compute: ComputeCost, link: Link, bytes_per_token: float,
                  layers: int = 1) -> float:
    """When the last slice's last byte lands, for `slices` in order: compute in series, sends in series,
    slice i's send starting once it is computed and slice i - 1 is sent. `layers` > 1: each slice goes
    as that many equal parts, part l sent as soon as it is computed (layer by layer within a slice)."""
    computed = sent = 0.0
    ctx = 0
    for s in slices:
        if s <= 0:
            raise ValueError(f"slice lengths must be positive, got {list(slices)}")
        c, d = compute(s, ctx), link.send_s(s * bytes_per_token)
        for part in range(layers):
            computed += c / layers
            # the slice's message latency once, with its first part; its bytes spread over the parts
            sent = max(sent, computed) + (d - link.latency_s) / layers + (link.latency_s if part == 0 else 0.0)
        ctx += s
    return sent


def best_slices(n_tokens: int, compute: ComputeCost, link: Link, bytes_per_token: float, granule: int = 1,
                max_slices: int | None = None, layers: int = 1) -> tuple[list[int], float]:
    """The slice lengths (multiples of `granule`, the last one whatever is left) minimising
    `pipeline_time` (with the same `layers`), and that time."""
    if n_tokens <= 0 or granule <= 0:
        raise ValueError(f"n_tokens and granule must be positive, got {n_tokens}, {granule}")
    units = math.ceil(n_tokens / granule)
    k_max = min(units, max_slices or units)

    def pos(u: int) -> int:  # token position of unit boundary u
        return min(u * granule, n_tokens)

    @lru_cache(maxsize=None)
    def h(u: int, r: int) -> tuple[float, int]:
        """(H, first slice's units) for tokens from unit u on, in exactly r slices."""
        if u == units:
            return (-math.inf, 0) if r == 0 else (math.inf, 0)
        if r == 0 or units - u < r:
            return math.inf, 0
        p = pos(u)
        best = (math.inf, 0)
        for step in range(1, units - u - r + 2):  # leave at least one unit for each later slice
            rest, _ = h(u + step, r - 1)
            if rest == math.inf:
                continue
            s = pos(u + step) - p
            c = compute(s, p)
            bytes_s = s * bytes_per_token / link.bytes_per_s
            later = (r - 1) * link.latency_s + (n_tokens - p - s) * bytes_per_token / link.bytes_per_s
            # this slice's own term: its critical path leaves the engine after its first or its last part
            own = max(link.latency_s + c / layers + bytes_s, c + bytes_s / layers) + later
            t = max(own, c + rest)
            if t < best[0]:
                best = (t, step)
        return best

    best_t, best_k = math.inf, 1
    for k in range(1, k_max + 1):
        t, _ = h(0, k)
        if t < best_t:
            best_t, best_k = t, k
    slices, u, r = [], 0, best_k
    while r:
        step = h(u, r)[1]
        slices.append(pos(u + step) - pos(u))
        u, r = u + step, r - 1
    h.cache_clear()
    # The uniform slicings are DP candidates already; scoring them (and the DP's answer) with the same
    # forward pass makes "never worse than uniform" hold to the last bit, not only up to rounding.
    best = (pipeline_time(slices, compute, link, bytes_per_token, layers), slices)
    for units_each in range(1, units + 1):
        uniform = uniform_slices(n_tokens, units_each * granule)
        if len(uniform) <= k_max:
            t = pipeline_time(uniform, compute, link, bytes_per_token, layers)
            if t < best[0]:
                best = (t, uniform)
    return best[1], best[0]


def uniform_slices(n_tokens: int, size: int) -> list[int]:
    """`size`-token slices, the last one what is left."""
    if size <= 0:
        raise ValueError(f"slice size must be positive, got {size}")
    return [min(size, n_tokens - a) for a in range(0, n_tokens, size)]




@dataclass(frozen=True)
class PrefillCost:
    """t(n, ctx) = a + b n + c n ctx + d n^2 seconds for an n-token slice after ctx tokens (see the top)."""

    a: float
    b: float
    c: float
    d: float
    floor_s: float = 1e-6  # never predict a free (or negative-time) slice: the DP would slice without end

    def __post_init__(self):
        if min(self.a, self.b, self.c, self.d) < 0 or self.floor_s <= 0:
            raise ValueError(f"cost coefficients must be non-negative and the floor positive, got {self}")

    def __call__(self, n: int, ctx: int) -> float:
        return max(self.a + self.b * n + self.c * n * ctx + self.d * n * n, self.floor_s)

    @staticmethod
    def _terms(n: float, ctx: float) -> tuple[float, float, float, float]:
        return 1.0, n, n * ctx, n * n

    @classmethod
    def fit(cls, points: Iterable[tuple[int, int, float]]) -> "PrefillCost":
        """Least squares on relative error over (n, ctx, seconds) points, coefficients >= 0: exact
        non-negative least squares by trying every set of free coefficients (4 of them: 16 sets) and
        keeping the best solution whose coefficients are all >= 0 (the optimum is one of them)."""
        pts = [(int(n), int(ctx), float(t)) for n, ctx, t in points]
        if any(n <= 0 or ctx < 0 or not t > 0 for n, ctx, t in pts):
            raise ValueError("cost points need n > 0, ctx >= 0 and a positive time")
        if len({(n, ctx) for n, ctx, _ in pts}) < 4:
            raise ValueError("fitting four coefficients needs at least four distinct (n, ctx) points")
        # rows weighted by 1 / t (relative error: a 60 ms slice counts as much as a 6 s one);
        # columns scaled to unit size so the solve is well conditioned   [points, 4]
        x = np.array([cls._terms(n, ctx) for n, ctx, _ in pts]) / np.array([[t] for *_, t in pts])
        y = np.ones(len(pts))
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        xs = x / scale
        best_res, best_coef = math.inf, np.zeros(4)
        for free in itertools.chain.from_iterable(itertools.combinations(range(4), k) for k in range(1, 5)):
            cols = list(free)
            sol, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(4)
            coef[cols] = sol
            res = float(np.sum((xs @ coef - y) ** 2))
            if res < best_res - 1e-15:
                best_res, best_coef = res, coef
        a, b, c, d = (float(v) for v in best_coef / scale)
        return cls(a, b, c, d)

    def relative_errors(self, points: Iterable[tuple[int, int, float]]) -> list[float]:
        """(predicted - measured) / measured at each point."""
        return [(self(n, ctx) - t) / t for n, ctx, t in points]

    def to_json(self) -> dict:
        return {"a_s": self.a, "b_s_per_token": self.b, "c_s_per_token_ctx": self.c, "d_s_per_token2": self.d}

    @classmethod
    def from_json(cls, d: dict) -> "PrefillCost":
        return cls(d["a_s"], d["b_s_per_token"], d["c_s_per_token_ctx"], d["d_s_per_token2"])
