"""What the router's stages miss before a first token, per mode (router.py's missed-waits term).

A request's time to its first token (taught as the token arrives) less what its mode's prefill,
hand-off and queueing were estimated at dispatch (before this term), the smallest over the mode's last
`recent` requests, never below 0, forgotten once `stale_after` auto decisions passed without one; when
the engines share one processor, only what it misses beyond the least of the modes' (a load's waits
are every mode's there, and so is the estimate's error under load). The stages time the engines'
compute; the waits around them are each mode's own (hybrid's hand-off admission and its turn to join
the decode batch, gpu mode's prefill taking turns on a shared processor): at 32 clients on two cores
hybrid's first token came after 7.7 s and gpu's after 5.4 s where fpga's came after 3.2 s, while the
estimates ranked hybrid and gpu first for half the requests. Not the whole request's: a decode's
slowdown in a busy batch is the batch term's and the decode correction's, and counted here too it
pushed the busiest mode's estimate up 20 s after one burst.

Plain state, no lock of its own: the router calls it under its lock.
"""
from __future__ import annotations

from collections import deque

from services.modes import MODE_NAMES


class FirstTokenWaits:
    def __init__(self, recent: int, stale_after: int):
        self._stale_after = stale_after
        # per mode, (auto decisions then, seconds its first token came later than estimated) of its last
        # `recent` requests
        self._missed: dict[str, deque] = {m: deque(maxlen=recent) for m in MODE_NAMES}

    def add(self, mode: str, decisions: int, shortfall: float) -> None:
        """A request of `mode`'s first token came `shortfall` seconds after the estimate (signed), at
        the `decisions`-th auto decision."""
        self._missed[mode].append((decisions, shortfall))

    def _shortfall(self, mode: str, decisions: int) -> float | None:
        """The smallest of the mode's last requests' shortfalls (signed), None without fresh ones."""
        recent = self._missed[mode]
        if not recent or decisions - recent[-1][0] > self._stale_after:
            return None
        return min(seconds for _, seconds in recent)

    def seconds(self, mode: str, decisions: int, shared: bool) -> float:
        """What the mode's stages, queueing and prefill ahead miss before the first token: its shortfall,
        >= 0. On one processor, beyond the least any mode's first tokens lately missed: a load's waits
        are every mode's there (the estimate's own error under load, over or under, is common to all),
        and what is left is the mode's own (hybrid's hand-off, its prefill beside a busy batch).
        Taken whole, a burst's wait taught only the mode it went to and herded the next burst to
        another; clamped at 0 each, an estimate that ran high under load hid what hybrid's first
        tokens waited beyond fpga's, and at 64 clients auto sent work to hybrid: TTFT p50 14.6 s,
        6.5 s with this (bench/results/serve_8_64_relative_missed.json). The least is of the modes'
        last samples, which may be of another load: a mode not run for a while is judged against
        the others' newer ones until its own go stale."""
        own = self._shortfall(mode, decisions)
        if own is None:
            return 0.0
        if not shared:
            return max(0.0, own)
        least = min(x for x in (self._shortfall(m, decisions) for m in MODE_NAMES) if x is not None)
        return max(0.0, own - least)
