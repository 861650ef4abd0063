"""When `hybridserve up --autoscale` starts or stops an engine of a pool: the decision, in plain Python.

The gateway's planner says how many engines each pool needs (`desired`); acting on every change of it
would flap, since its demand is a window's mean that jumps with each burst, and an engine costs tens of
seconds to start (model load, kernel build) and its streams' time to drain. So, per pool:

* the target is `desired` clamped to the bounds [min, max] (`up --prefill N --decode M` are the minimums);
* a step is taken only once the target has stayed on the same side of the current size for a hold
  (longer going down than up, as Kubernetes' HPA stabilizes scale-down: a lull in the middle of a load
  must not stop an engine that is needed again a moment later);
* after a step, none for a cooldown, whatever the planner says (the step's effect must show first);
* one engine per step (the next one needs its own hold and cooldown), so a planner's overshoot costs
  one engine, not ten.

A size outside the bounds (never reached through the steps above) is corrected at once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Hysteresis:
    up_hold_s: float = 30.0  # the target above the size for this long before an engine is started
    down_hold_s: float = 120.0  # below it for this long before one is drained and stopped
    cooldown_s: float = 60.0  # no step for this long after one


@dataclass(frozen=True)
class Decision:
    pool: str
    step: int  # +1: start an engine; -1: drain and stop one; 0: nothing now
    current: int
    desired: int  # the planner's
    target: int  # desired within the bounds
    why: str


class PoolScaler:
    """The decisions for one pool, between `lo` and `hi` engines; `decide` once per round."""

    def __init__(self, pool: str, lo: int, hi: int, hysteresis: Hysteresis,
                 clock: Callable[[], float] = time.monotonic):
        if not 1 <= lo <= hi:
            raise ValueError(f"{pool}: bounds need 1 <= min <= max, not [{lo}, {hi}]")
        self.pool, self.lo, self.hi, self.h, self._clock = pool, lo, hi, hysteresis, clock
        self._side = 0  # the side of the size the target was on at the last round (-1, 0, +1)
        self._since = 0.0  # since when it has been there
        self._last_step = float("-inf")

    def decide(self, desired: int, current: int) -> Decision:
        """What to do now with `current` engines (starting ones included, draining ones not) when the
        planner wants `desired`; a non-zero step counts as taken (the caller carries it out)."""
        now = self._clock()
        target = min(self.hi, max(self.lo, desired))
        side = (target > current) - (target < current)

        def say(step: int, why: str) -> Decision:
            if step:
                self._last_step, self._side, self._since = now, 0, now
            return Decision(self.pool, step, current, desired, target, why)

        if current < self.lo or current > self.hi:
            return say(side, f"outside the bounds [{self.lo}, {self.hi}]")
        if side != self._side:
            self._side, self._since = side, now
        if side == 0:
            at = " (at a bound)" if desired != target else ""
            return say(0, f"at the target{at}")
        hold = self.h.up_hold_s if side > 0 else self.h.down_hold_s
        held = now - self._since
        if held < hold:
            return say(0, f"target held {held:.1f} s of {hold:g} s")
        cooling = self._last_step + self.h.cooldown_s - now
        if cooling > 0:
            return say(0, f"cooldown: {cooling:.1f} s left")
        return say(side, f"target held {held:.1f} s")
