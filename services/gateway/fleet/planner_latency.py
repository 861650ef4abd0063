"""What the latencies users saw say about each pool: a floor under the planner's replica counts.

The planner's capacity model (planner.py) sizes the pools from the demand rate and profiled step
costs. It cannot see two kinds of shortage: a closed loop of clients never offers more than the stack
serves (the rate stays low however long they wait), and steps on a busy host cost more than the
profiles taken alone say. The TTFT and ITL the gateway measured show both, so they bound the model
from below, pool by pool:

* each first token's TTFT is charged to the pool whose engine computed it (gpu and hybrid mode:
  prefill; fpga mode: decode), each inter-token gap to the pool whose engine decodes (gpu mode:
  prefill; hybrid and fpga: decode) — Dynamo's split, TTFT for prefill and ITL for decode, extended
  to the single-device modes;
* only gaps and first tokens seen since the pool last changed size (within the window) count: those
  from before say nothing about the pool as it is, and counting them would add an engine for a
  miss the last one already fixed;
* the ratio r of a pool is its worst observed p50 over its target (with `min_samples` of a kind);
* r > 1 (a miss): the pool asks for max(N + 1, ceil(N x r)) engines, N being those it has now
  (latency taken as inversely proportional to engines, as Kubernetes' HPA scales on a ratio);
* r <= 1: the least n <= N at which N x r / n stays within `headroom` of the target: the size the
  pool can shrink to and still meet it with room to spare (so a step down does not miss at once);
* between `headroom` and 1, an outstanding ask stands: the floor moves only on a clear miss or a
  clear margin, so a p50 near the target does not flip the answer from round to round;
* too few samples since the change: the floor stands, until a whole window passes so (the load is
  too thin to judge) and it lapses; no traffic in the window: no floor.

The planner's desired count is the larger of the model's and this floor. Acting on it keeps the
autoscaler's own holds and cooldown (services/launcher/autoscale.py).
"""
from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

from services.modes import MODES

POOLS = ("prefill", "decode")
KINDS = ("ttft", "itl")


def pool_of(kind: str, mode: str) -> str:
    """The pool whose engine a TTFT (`kind` "ttft") or an inter-token gap ("itl") of `mode` measures."""
    m = MODES[mode]
    engine = m.prefill_engine if kind == "ttft" else m.decode_engine
    return "prefill" if engine == "gpu" else "decode"


class Observed:
    """Latencies the gateway measured, per (pool, kind), as (time, seconds); thread-safe. Each series
    keeps at most `cap` entries (the latest), so memory is bounded at any rate."""

    def __init__(self, cap: int = 20000):
        self._lock = threading.Lock()
        self._series = {(p, k): deque(maxlen=cap) for p in POOLS for k in KINDS}

    def add(self, kind: str, mode: str, seconds: float, now: float) -> None:
        series = self._series[(pool_of(kind, mode), kind)]
        with self._lock:
            series.append((now, seconds))

    def since(self, pool: str, kind: str, start: float) -> list[float]:
        """The seconds observed at or after `start`."""
        with self._lock:
            series = self._series[(pool, kind)]
            while series and series[0][0] < start - 3600:  # older than any window: let them go
                series.popleft()
            return [s for t, s in series if t >= start]


@dataclass
class Reading:
    """One pool's latency evidence at an evaluation, and the floor it set (what /debug/planner shows)."""

    engines: int  # N: the pool's serving engines now
    p50: dict[str, float | None]  # per kind, over the samples counted (None: too few)
    samples: dict[str, int]
    ratio: float | None  # the worst p50 over its target; None without evidence
    floor: int  # 0: no floor
    why: str


@dataclass
class _PoolState:
    floor: int = 0
    size: int = 0
    since: float = -math.inf  # when the planner saw the pool reach its present size
    last: Reading | None = field(default=None)


def floor_for(ratio: float, engines: int, headroom: float) -> int:
    """The engines the rule asks for at `ratio` with `engines` now (no memory: `LatencyFloor` adds it)."""
    if ratio > 1:
        return max(engines + 1, math.ceil(engines * ratio - 1e-9))
    return min(engines, max(1, math.ceil(engines * ratio / headroom - 1e-9)))


class LatencyFloor:
    """The floor per pool, from `Observed` and the pools' sizes; call `update` at each evaluation."""

    def __init__(self, observed: Observed, min_samples: int = 5, headroom: float = 0.8):
        if not 0 < headroom < 1:
            raise ValueError(f"headroom must be in (0, 1), not {headroom}")
        self.observed, self.min_samples, self.headroom = observed, max(1, min_samples), headroom
        self._state = {p: _PoolState() for p in POOLS}
        self._lock = threading.Lock()

    def update(self, pool: str, engines: int, targets: dict[str, float], now: float, window_s: float,
               traffic: bool) -> Reading:
        """The pool's reading now. `targets`: seconds per kind; `traffic`: any request in the window."""
        with self._lock:
            st = self._state[pool]
            if engines != st.size:  # (the size at the first evaluation counts as the pool's all along)
                st.size, st.since = engines, (now if st.size else st.since)
            start = max(now - window_s, st.since)
            p50, samples, ratios = {}, {}, []
            for kind in KINDS:
                xs = self.observed.since(pool, kind, start)
                samples[kind] = len(xs)
                p50[kind] = statistics.median(xs) if len(xs) >= self.min_samples else None
                if p50[kind] is not None:
                    ratios.append(p50[kind] / targets[kind])
            ratio = max(ratios) if ratios else None
            if not traffic:
                st.floor, why = 0, "no traffic in the window"
            elif ratio is None:
                if now - st.since >= window_s:
                    st.floor, why = 0, f"fewer than {self.min_samples} samples over a window: too thin to judge"
                else:
                    why = f"fewer than {self.min_samples} samples since the pool became {engines}: floor stands"
            else:
                asked = floor_for(ratio, engines, self.headroom)
                if st.floor > engines and self.headroom < ratio <= 1:
                    why = f"p50 at {ratio:.2f} of its target, within the band ({self.headroom:g}, 1]: the ask stands"
                else:
                    st.floor = asked
                    why = (f"p50 at {ratio:.2f} of its target: a miss" if ratio > 1
                           else f"p50 at {ratio:.2f} of its target: met")
            st.last = Reading(engines, p50, samples, ratio, st.floor, why)
            return st.last
