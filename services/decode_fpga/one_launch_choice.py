"""Whether a one-sequence decode step runs as one launch or launch by launch, from how each has been doing.

The one-launch step (kernels/decode_layers.cl) is about twice as fast on an idle CPU, but its
work-groups wait for each other at ~180 barriers a step: when another process takes a core
from one of them, the other spins until it comes back. Measured here (2 cores, batch 1, a
128-token context, a give-up limit per barrier as it then was): one busy process made its p90
step 89 ms where launch by launch stayed at 13; two made it 685 ms. Launch by launch lets PoCL
hand a descheduled thread's work-groups to the other, so it only slows down by the core it lost.
bench/micro/one_launch_busy.py measures the three ways (always one, always launches, this choice).

So the engine times both ways and runs the one whose recent steps were faster. It tries the
other way for `probe_steps` steps when the way it runs has got slower than the other way was
last seen (the median of its last `window` steps since the last try), when a step gave up, and
when the try interval has passed; then it runs `probe_steps` steps its own way again, and
changes ways when the medians of the two sets differ by more than `margin` (a step that gave up
counts as infinitely slow). Both sets are measured side by side, so a slowdown that passes
within a few steps (a hand-off's cold caches, a burst of work in the gateway) changes nothing.
The try interval starts at `first_probe_s` and doubles each time a try confirms the choice (up
to `max_probe_s`): a busy spell is left within ten steps, and a quiet one is found again within
a few tries, at a few slow steps a minute.
A new engine runs one launch and first tries the other way `first_probe_s` after its first step.
`fixed` pins one way (benchmarks and tests; a one launch that gives up is still redone).
Steps of several rows that may run as one launch (paged_rows_layers) have a choice of their own
for each row count (`rows`): their times differ from one row's, and from each other's.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from typing import Callable, TypeVar

from services.engine import metrics

log = logging.getLogger(__name__)
T = TypeVar("T")
_LABEL = {True: "one launch", False: "launch by launch"}
_STEPS = {way: metrics.ONE_ROW_STEPS.labels(_LABEL[way]) for way in (True, False)}

# Polls of a step's barriers (by one work-group) before decode_layers.cl gives up: ~12 ms at the
# ~0.35 ns a poll measured here (an L1-resident counter), three quiet steps' worth at batch 1. A
# step stalled longer is better given up on: it is redone launch by launch and counts against
# one launch above. (A limit per barrier let a step stall at each of its ~180: 750 ms steps.)
BARRIER_SPIN_LIMIT = 1 << 25


class OneLaunchChoice:
    """The way of one engine's one-sequence decode steps; not thread-safe (the engine's lock holds it)."""

    def __init__(self, device_name: str = "the device", window: int = 5, probe_steps: int = 3, margin: float = 0.1,
                 first_probe_s: float = 0.25, max_probe_s: float = 32.0,
                 clock: Callable[[], float] = time.monotonic, fixed: bool | None = None, rows: int = 1):
        self.device_name, self.rows = device_name, rows
        self._steps = _STEPS if rows == 1 else {way: metrics.FEW_ROW_STEPS.labels(_LABEL[way], str(rows))
                                                for way in (True, False)}
        self.window, self.probe_steps, self.margin = window, probe_steps, margin
        self.first_probe_s, self.max_probe_s = first_probe_s, max_probe_s
        self.clock, self.fixed = clock, fixed
        self._times = {True: deque(maxlen=window), False: deque(maxlen=window)}
        self.current = True  # the way steps run, probes aside
        self._probe_left = 0  # steps of the other way still to run in the current try
        self._recheck_left = 0  # then steps of the current way, to compare with
        self._interval = first_probe_s
        self._next_probe = math.inf  # set by the first step
        self._since_try = 0  # steps the current way ran since the last try
        self.gave_up = 0  # one-launch steps that gave up, all told
        self.ran = {True: 0, False: 0}  # steps that ran to the end each way, all told
        self.switches = 0

    def run(self, step: Callable[[bool], T | None]) -> T:
        """step(one_launch) the way chosen, timed for the choice; a one launch that gave up (step
        returned None) is run again launch by launch (it rewrites the KV the void step wrote with
        the same values)."""
        one_launch = self.one_launch()
        start = time.perf_counter()
        out = step(one_launch)
        gave_up = out is None
        if gave_up:
            log.log(logging.WARNING if self.gave_up == 0 else logging.DEBUG,
                    "decode_layers' work-groups did not all run at once on %s (another process took a core): "
                    "the step is redone launch by launch, and steps run the way that has been faster lately "
                    "(later ones are logged at DEBUG)", self.device_name)
            metrics.ONE_LAUNCH_GAVE_UP.inc()
            out = step(False)
        self.record(one_launch, time.perf_counter() - start, gave_up)
        self._steps[one_launch and not gave_up].inc()
        return out

    def one_launch(self) -> bool:
        """Whether the next one-sequence decode step runs as one launch."""
        if self.fixed is not None:
            return self.fixed
        if not self._trying() and self.clock() >= self._next_probe:
            self._start_probe()
        return self.current if self._probe_left == 0 else not self.current

    def record(self, one_launch: bool, seconds: float, gave_up: bool = False) -> None:
        """A one-sequence step ran `one_launch` (or not) in `seconds`; gave_up: its one launch gave up
        and it was redone launch by launch (seconds counts both)."""
        if math.isinf(self._next_probe):
            self._next_probe = self.clock() + self.first_probe_s
        self._times[one_launch].append(math.inf if gave_up else seconds)
        self.ran[one_launch and not gave_up] += 1
        if gave_up:
            self.gave_up += 1
        if self.fixed is not None:
            return
        if one_launch != self.current:
            self._probe_left -= 1
            self._recheck_left = self.probe_steps if self._probe_left <= 0 else 0
        elif self._recheck_left > 0:
            self._recheck_left -= 1
            if self._recheck_left == 0:
                self._decide()
        else:
            self._since_try += 1
            if gave_up or self._slower_than_other_was():
                self._start_probe()

    def median(self, one_launch: bool, last: int | None = None) -> float:
        """The median of that way's recent step times (inf when a way has none)."""
        times = list(self._times[one_launch])[-(last or self.window):]
        return statistics.median(times) if times else math.inf

    def state(self) -> dict:
        return {"one_launch": self.current, "one_launch_ms": _ms(self.median(True)),
                "launch_by_launch_ms": _ms(self.median(False)), "one_launch_steps": self.ran[True],
                "launch_by_launch_steps": self.ran[False], "gave_up": self.gave_up, "switches": self.switches,
                "next_try_s": self._interval}

    # ---- internals --------------------------------------------------------------------
    def _trying(self) -> bool:
        return self._probe_left > 0 or self._recheck_left > 0

    def _slower_than_other_was(self) -> bool:
        if self._since_try < self.window:
            return False
        return self.median(self.current) > (1 + self.margin) * self.median(not self.current, self.probe_steps)

    def _start_probe(self) -> None:
        self._probe_left = self.probe_steps
        self._since_try = 0

    def _decide(self) -> None:
        """After a try of the other way and as many steps this way again: the two sets of steps."""
        tried = not self.current
        new, old = self.median(tried, self.probe_steps), self.median(self.current, self.probe_steps)
        if (1 + self.margin) * new < old:
            log.info("decode steps of %s now run %s (%.2f ms a step; %s)",
                     "one sequence" if self.rows == 1 else f"{self.rows} rows", _way(tried), new * 1e3,
                     "one launch gave up" if math.isinf(old) else f"the other way {old * 1e3:.2f} ms")
            self.current = tried
            self.switches += 1
            self._interval = self.first_probe_s
        else:
            self._interval = min(2 * self._interval, self.max_probe_s)
        self._next_probe = self.clock() + self._interval


def _way(one_launch: bool) -> str:
    return "as one launch" if one_launch else "launch by launch"


def _ms(seconds: float) -> float | None:
    return None if math.isinf(seconds) else round(seconds * 1e3, 2)
