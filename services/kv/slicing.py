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
later slices' sends (b_j: its bytes' time; the latency rides with its first part), the rest unchanged. Lengths are multiples of a granule (the engine's block size, say)
so the table stays small: O((n / granule)^3) steps, pure Python.

`CostTable` is t(slice length, context) measured on an engine at a few points and interpolated
bilinearly (extrapolated linearly past the grid), since a prompt's slices fall between them.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

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
    return slices, best_t


def uniform_slices(n_tokens: int, size: int) -> list[int]:
    """`size`-token slices, the last one what is left."""
    if size <= 0:
        raise ValueError(f"slice size must be positive, got {size}")
    return [min(size, n_tokens - a) for a in range(0, n_tokens, size)]


class CostTable:
    """t(slice length, context) from measurements on a grid, bilinear inside, linear past the edges."""

    def __init__(self, lengths: Sequence[int], contexts: Sequence[int], seconds: Sequence[Sequence[float]]):
        """seconds[i][j]: a slice of lengths[i] tokens after contexts[j] tokens (both ascending, >= 2 points)."""
        if len(lengths) < 2 or len(contexts) < 2:
            raise ValueError("a cost table needs at least two lengths and two contexts")
        if list(lengths) != sorted(set(lengths)) or list(contexts) != sorted(set(contexts)):
            raise ValueError("lengths and contexts must be strictly ascending")
        if len(seconds) != len(lengths) or any(len(row) != len(contexts) for row in seconds):
            raise ValueError(f"seconds must be {len(lengths)} × {len(contexts)}")
        self.lengths, self.contexts = list(lengths), list(contexts)
        self.seconds = [list(map(float, row)) for row in seconds]

    @staticmethod
    def _bracket(grid: list[int], x: float) -> tuple[int, float]:
        """Index i and weight w with x = (1 - w) grid[i] + w grid[i + 1] (w outside [0, 1] past the edges)."""
        i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
        return i, (x - grid[i]) / (grid[i + 1] - grid[i])

    def __call__(self, length: int, context: int) -> float:
        i, wl = self._bracket(self.lengths, length)
        j, wc = self._bracket(self.contexts, context)
        s = self.seconds
        lo = (1 - wc) * s[i][j] + wc * s[i][j + 1]
        hi = (1 - wc) * s[i + 1][j] + wc * s[i + 1][j + 1]
        return max((1 - wl) * lo + wl * hi, 0.0)

    def to_json(self) -> dict:
        return {"lengths": self.lengths, "contexts": self.contexts, "seconds": self.seconds}

    @classmethod
    def from_json(cls, d: dict) -> "CostTable":
        return cls(d["lengths"], d["contexts"], d["seconds"])
