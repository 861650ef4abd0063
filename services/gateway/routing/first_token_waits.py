"""What the router's stages miss before a first token, per mode (router.py's missed-waits term).

A request's time to its first token (taught as the token arrives) less what its mode's prefill,
hand-off and queueing were estimated at dispatch (before this term), the smallest over the mode's last
`recent` requests, never below 0, forgotten once `stale_after` auto decisions passed without one; when
the engines share one processor, only what it misses beyond the least of the modes' at the same time
(a load's waits are every mode's there, and so is the estimate's error under load). The stages time the engines'
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


HISTORY = 64  # first tokens kept per mode: enough to find another mode's of the same time


class FirstTokenWaits:
    def __init__(self, recent: int, stale_after: int):
        self._recent, self._stale_after = recent, stale_after
        # per mode, (auto decisions then, seconds its first token came later than estimated), newest last
        self._missed: dict[str, deque] = {m: deque(maxlen=HISTORY) for m in MODE_NAMES}

    def add(self, mode: str, decisions: int, shortfall: float) -> None:
        """A request of `mode`'s first token came `shortfall` seconds after the estimate (signed), at
        the `decisions`-th auto decision."""
        self._missed[mode].append((decisions, shortfall))

    def _shortfall(self, mode: str, decisions: int) -> float | None:
        """The smallest of the mode's last `recent` shortfalls (signed), None without fresh ones."""
        own = self._missed[mode]
        if not own or decisions - own[-1][0] > self._stale_after:
            return None
        return min(seconds for _, seconds in list(own)[-self._recent:])

    def _least_then(self, newest: int) -> float | None:
        """The least of the modes' smallest shortfalls over their last `recent` first tokens as of the
        `newest`-th auto decision (later ones left out, and those stale by then), None where none
        had one."""
        least = None
        for samples in self._missed.values():
            then = [seconds for at, seconds in samples
                    if newest - self._stale_after <= at <= newest][-self._recent:]
            if then:
                least = min(then) if least is None else min(least, min(then))
        return least

    def seconds(self, mode: str, decisions: int, shared: bool) -> float:
        """What the mode's stages, queueing and prefill ahead miss before the first token: its shortfall,
        >= 0. On one processor, beyond the least any mode's first tokens missed at the same time: a
        load's waits are every mode's there (the estimate's own error under load, over or under, is
        common to all), and what is left is the mode's own (hybrid's hand-off, its prefill beside a
        busy batch). Taken whole, a burst's wait taught only the mode it went to and herded the next
        burst to another; clamped at 0 each, an estimate that ran high under load hid what hybrid's
        first tokens waited beyond fpga's, and at 64 clients auto sent work to hybrid: TTFT p50
        14.6 s, 6.5 s with this (bench/results/serve_8_64_relative_missed.json).

        The others' first tokens it is measured against are those up to its own newest (the last
        `recent` of each as of then), not newer ones of another load: judged against the others'
        latest, a mode that auto stopped choosing was judged against a load it never ran under. At
        32 clients after 8, hybrid's last first tokens, from the 8-client round, had missed 3.5 s
        beyond fpga's then; against fpga's of the 32-client round, whose estimates ran high, its
        term rose to 18-41 s, and auto sent the rest of the round to fpga (77-78 tokens/s against
        90-99 where it kept sending prompts to hybrid; docs/speculation.md). A mode whose own first
        tokens are the newest is still judged against the others' last ones, older: if that makes it
        look slow, auto sends work to the others and their newer first tokens correct it (the mode's
        own are always among those it is judged against, so the term is never below 0)."""
        own = self._shortfall(mode, decisions)
        if own is None:
            return 0.0
        if not shared:
            return max(0.0, own)
        least = self._least_then(self._missed[mode][-1][0])
        return max(0.0, own - least)
