"""What waits on each engine, for the router's queueing and prefill-ahead terms (router.py).

Plain state, no lock of its own: the router calls it under its lock.

* prefill ahead: the prefill (and hand-off) seconds, as estimated at their dispatch, of the requests sent
  and still waiting for their first token, on the mode's prefill engine, or on both when they share one
  processor (then the cores do one prompt at a time whichever engine holds it: every mode alike).
  A burst's last request waits for the prompts of all before it; without this term that wait was
  learned after the fact as the mode's missed seconds, by the mode the burst went to only: at 32
  clients fpga's came out 7.6 s while hybrid's was 0, and the next 32 requests all went to hybrid,
  whose prompts then queued on prefill_gpu (TTFT p50 4.4 s against forced fpga's 3.3 s);
* queueing: the requests on each engine x that engine's measured service time (its own stage
  seconds, not the end-to-end time) / the sequences its batch holds. The requests: those the
  engine itself reports running and waiting (Info, polled every health interval; other gateways'
  included) plus the ones this gateway sent since. When the two engines
  share one processor (`shared`: the CPU build of both, as on a machine without
  accelerators), work queued on either delays both alike, so every mode gets the same
  queueing term and the choice follows each mode's own cost.
"""
from __future__ import annotations

from services.modes import ENGINES, MODES


class EngineQueues:
    def __init__(self):
        self.busy = {e: 0 for e in ENGINES}  # requests this gateway has on each engine
        self.ahead = {e: 0.0 for e in ENGINES}  # prefill seconds of the requests sent, awaiting their first token
        self.e2e = {e: 0.0 for e in ENGINES}  # mean end-to-end seconds: service time until stages are seen
        self.service = {e: 0.0 for e in ENGINES}  # mean seconds of the engine's own stages per request
        self.concurrency = {e: 1 for e in ENGINES}
        self.engines_up = {e: 1 for e in ENGINES}  # engines of each kind this gateway reaches (pairs, pools)
        self.engine_load = {e: (0, 0, 0) for e in ENGINES}  # (running, waiting, busy here when reported)

    def started(self, mode: str, prefill_s: float) -> None:
        for e in MODES[mode].engines:
            self.busy[e] += 1
        self.ahead[MODES[mode].prefill_engine] += prefill_s

    def finished(self, mode: str, seconds: float | None, prefill_s: float) -> None:
        for e in MODES[mode].engines:
            self.busy[e] = max(0, self.busy[e] - 1)
            if seconds is not None:
                self.e2e[e] = seconds if not self.e2e[e] else 0.8 * self.e2e[e] + 0.2 * seconds
        engine = MODES[mode].prefill_engine
        self.ahead[engine] = max(0.0, self.ahead[engine] - prefill_s)
        if not any(self.busy.values()):
            self.ahead = {e: 0.0 for e in ENGINES}  # float sums back to exactly nothing when idle

    def served(self, seconds_per_engine: dict[str, float]) -> None:
        """A finished request's stage seconds on each engine: its service time, smoothed."""
        for e, seconds in seconds_per_engine.items():
            if e in self.service:
                self.service[e] = seconds if not self.service[e] else 0.8 * self.service[e] + 0.2 * seconds

    def prefill_ahead(self, mode: str, shared: bool) -> float:
        """Prefill seconds a new request of `mode` waits behind: of the requests sent and awaiting their
        first token on its prefill engine, or on either when the engines share one processor. The sum
        is over every engine of the kind this gateway reaches; on separate devices N of them prefill
        side by side (the placement spreads the prompts), so a new prompt waits behind 1/N of it; on one
        processor they all take turns on the same cores, however many there are."""
        if shared:
            return sum(self.ahead.values())
        engine = MODES[mode].prefill_engine
        return self.ahead[engine] / max(1, self.engines_up[engine])

    def set_load(self, engine: str, running: int, waiting: int, max_num_seqs: int, engines: int) -> None:
        self.concurrency[engine] = max(1, max_num_seqs)
        self.engines_up[engine] = max(1, engines)
        self.engine_load[engine] = (running, waiting, self.busy[engine])

    def queued(self, engine: str) -> int:
        """Requests on `engine` that a new one shares it with: what the engine last reported (running
        and waiting) plus what this gateway sent it since; before any report, what this gateway sent."""
        running, waiting, busy_then = self.engine_load[engine]
        if not (running or waiting):
            return self.busy[engine]
        return running + waiting + max(0, self.busy[engine] - busy_then)

    def company(self, shared: bool) -> dict[str, int]:
        """Per engine, the requests a new one would share it with: the engine's own, or, when the
        engines share one processor, the busier engine's (a hybrid request is on both: not twice)."""
        own = {e: self.queued(e) for e in ENGINES}
        return {e: max(own.values()) for e in ENGINES} if shared else own

    def queueing(self, mode: str, shared: bool) -> float:
        """Seconds a new request waits behind the work already queued on the mode's engines."""
        engines = ENGINES if shared else MODES[mode].engines
        return max(self.queued(e) * (self.service[e] or self.e2e[e]) / max(1, self.concurrency[e])
                   for e in engines)

    def snapshot(self, engine: str) -> dict:
        return {"busy": self.busy[engine], "concurrency": self.concurrency[engine],
                "running": self.engine_load[engine][0], "waiting": self.engine_load[engine][1],
                "service_s": self.service[engine], "e2e_s": self.e2e[engine]}
