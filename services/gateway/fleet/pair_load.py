"""Which (prefill_gpu, decode_fpga) pair serves a request, once the router has picked its mode.

Pure Python, no gRPC: the watch (engine_watch.py) reports what each engine says of its batch
every health interval, the dispatcher says when a call starts and ends, and `choose` answers
with the least loaded pair among those that can serve the mode.

    load(pair, mode) = max over the mode's engines of
                       (running + waiting as last reported + calls this gateway opened since) / max_num_seqs

The calls opened since the report matter because a report is up to one health interval old:
a burst of requests would otherwise all go to the pair that looked idle. Nor does an engine ever count
fewer requests than this gateway has open on it: a report is taken when its Info reply lands, so a
call opened while that Info was on the wire counts as seen by an engine that had not seen it yet
(CI once placed a request beside a long stream for that). Ties (as between
idle pairs) go to the lower KV-cache usage, then to the pair this gateway has fewer calls on,
then to the lower index, so that the choice is deterministic.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from services.modes import MODES


@dataclass(frozen=True)
class EngineReport:
    """What one engine said of its batch (its Info), and this gateway's calls on it at that moment."""

    running: int
    waiting: int
    max_num_seqs: int
    kv_usage: float  # blocks held / all blocks, 0..1
    ours_then: int


class PairLoads:
    """Thread-safe load book of every pair; pairs are keyed by a small int (their metrics label)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reports: dict[tuple[int, str], EngineReport] = {}
        self._ours: dict[tuple[int, str], int] = {}  # calls this gateway has open on (pair, engine)
        self._calls: dict[int, int] = {}  # calls this gateway has open on a pair, any mode (draining waits on it)

    def report(self, pair: int, engine: str, running: int, waiting: int, max_num_seqs: int,
               kv_usage: float) -> None:
        with self._lock:
            self._reports[(pair, engine)] = EngineReport(running, waiting, max(1, max_num_seqs), kv_usage,
                                                         self._ours.get((pair, engine), 0))

    def forget(self, pair: int) -> None:
        """A pair that left (its pod is gone): its reports go; calls still open finish as usual."""
        with self._lock:
            for key in [k for k in self._reports if k[0] == pair]:
                del self._reports[key]

    def started(self, pair: int, mode: str) -> None:
        with self._lock:
            self._calls[pair] = self._calls.get(pair, 0) + 1
            for e in MODES[mode].engines:
                self._ours[(pair, e)] = self._ours.get((pair, e), 0) + 1

    def finished(self, pair: int, mode: str) -> None:
        with self._lock:
            self._calls[pair] = max(0, self._calls.get(pair, 0) - 1)
            for e in MODES[mode].engines:
                self._ours[(pair, e)] = max(0, self._ours.get((pair, e), 0) - 1)

    def calls(self, pair: int) -> int:
        """Calls this gateway has open on `pair`, whatever their mode."""
        with self._lock:
            return self._calls.get(pair, 0)

    def open_calls(self) -> int:
        """Calls this gateway has open on any pair (the calibration check yields to them)."""
        with self._lock:
            return sum(self._calls.values())

    def ours(self, pair: int, engine: str) -> int:
        with self._lock:
            return self._ours.get((pair, engine), 0)

    def load(self, pair: int, mode: str) -> tuple[float, float]:
        """(queue share, KV usage) of the busier of the mode's engines on `pair`."""
        with self._lock:
            return self._load(pair, mode)

    def _load(self, pair: int, mode: str) -> tuple[float, float]:
        share, kv = 0.0, 0.0
        for e in MODES[mode].engines:
            ours = self._ours.get((pair, e), 0)
            r = self._reports.get((pair, e))
            if r is None:  # no report yet: what this gateway sent, against a batch of one
                share = max(share, float(ours))
                continue
            queued = _queued(r, ours)
            share, kv = max(share, queued / r.max_num_seqs), max(kv, r.kv_usage)
        return share, kv

    def queued(self, pair: int, mode: str) -> int:
        """Requests on the busier of the mode's engines of `pair`: as reported, plus calls opened since."""
        with self._lock:
            most = 0
            for e in MODES[mode].engines:
                ours = self._ours.get((pair, e), 0)
                r = self._reports.get((pair, e))
                most = max(most, ours if r is None else _queued(r, ours))
            return most

    def choose(self, mode: str, candidates: list[int]) -> int:
        """The least loaded of `candidates` (pairs whose engines for `mode` are up) for `mode`."""
        if not candidates:
            raise LookupError(f"no pair can serve mode {mode}")
        with self._lock:
            def key(p: int):
                share, kv = self._load(p, mode)
                ours = sum(self._ours.get((p, e), 0) for e in MODES[mode].engines)
                return share, kv, ours, p
            return min(candidates, key=key)


def _queued(r: EngineReport, ours: int) -> int:
    """Requests on an engine: its report, plus this gateway's calls opened since; never fewer than
    the calls this gateway has open on it now."""
    return max(r.running + r.waiting + max(0, ours - r.ours_then), ours)
