"""The router: pick gpu, fpga or hybrid per request from a fitted cost model.

Pure Python and numpy, no torch or OpenCL, so it is unit-tested in milliseconds.

    T(mode) = prefill(device, n_in) + handoff(n_in) + decode(device, n_in, n_out) + queueing

* prefill(d, n)   = a + b n + c n^2       (attention makes long prompts super-linear)
* decode(d, n, m) = m (p + q (n + m/2))   (each token re-reads weights plus a KV that grows)
* handoff(n)      = h0 + h1 n             (the exposed part only: hybrid mode only)
* queueing        = requests already on the engine x its recent mean latency / its concurrency

Each term is a least-squares fit to stage-timing samples `{"stage", "device", "n_in",
"n_out", "seconds"}` (decode seconds = the total for n_out tokens): from each
engine's Profile at start-up, then from every finished request's timings.

    python -m services.gateway.router --calibration FILE --n-in N --n-out M
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from services.modes import MODE_NAMES, MODES



@dataclass(frozen=True)
class Decision:
    mode: str
    reason: str  # "auto" | "forced" | "fallback"
    estimates: dict[str, float]  # seconds per mode; only the modes considered


def _lstsq(features: list[list[float]], targets: list[float]) -> np.ndarray:
    coef, *_ = np.linalg.lstsq(np.asarray(features, float), np.asarray(targets, float), rcond=None)
    return coef


@dataclass
class CostModel:
    """Fitted coefficients; `fit` rebuilds them from samples."""

    prefill: dict[str, np.ndarray] = field(default_factory=dict)
    decode: dict[str, np.ndarray] = field(default_factory=dict)
    handoff: np.ndarray | None = None

    @classmethod
    def fit(cls, samples: list[dict]) -> "CostModel":
        m = cls()
        for dev in ("gpu", "fpga"):
            pre = [s for s in samples if s["stage"] == "prefill" and s.get("device") == dev]
            if pre:
                n_distinct = len({s["n_in"] for s in pre})
                feats = [[1.0, s["n_in"], s["n_in"] ** 2][: min(3, n_distinct)] for s in pre]
                m.prefill[dev] = _lstsq(feats, [s["seconds"] for s in pre])
            dec = [s for s in samples if s["stage"] == "decode" and s.get("device") == dev and s.get("n_out")]
            if dec:
                ctx = [s["n_in"] + s["n_out"] / 2 for s in dec]
                feats = [[1.0, c] for c in ctx] if len(set(ctx)) > 1 else [[1.0] for _ in ctx]
                m.decode[dev] = _lstsq(feats, [s["seconds"] / s["n_out"] for s in dec])
        hand = [s for s in samples if s["stage"] == "handoff"]
        if hand:
            feats = [[1.0, s["n_in"]] for s in hand] if len({s["n_in"] for s in hand}) > 1 else [[1.0] for _ in hand]
            m.handoff = _lstsq(feats, [s["seconds"] for s in hand])
        return m

    def can_estimate(self, mode: str) -> bool:
        ok = MODES[mode].prefill_engine in self.prefill and MODES[mode].decode_engine in self.decode
        return ok and (mode != "hybrid" or self.handoff is not None)

    def estimate(self, mode: str, n_in: int, n_out: int) -> float:
        p = self.prefill[MODES[mode].prefill_engine]
        t = float(np.dot(p, [1.0, n_in, n_in ** 2][: len(p)]))
        d = self.decode[MODES[mode].decode_engine]
        t += n_out * float(np.dot(d, [1.0, n_in + n_out / 2][: len(d)]))
        if mode == "hybrid":
            t += float(np.dot(self.handoff, [1.0, n_in][: len(self.handoff)]))
        return max(t, 0.0)


class Router:
    """Thread-safe: samples arrive from finished requests while others are routed."""

    def __init__(self, samples: list[dict] | None = None, window: int = 256, refit_every: int = 8):
        self._base = list(samples or [])
        self._online: deque = deque(maxlen=window)
        self._refit_every, self._since_fit = refit_every, 0
        self._lock = threading.Lock()
        self.model = CostModel.fit(self._base)
        self._busy = {"gpu": 0, "fpga": 0}
        self._mean_latency = {"gpu": 0.0, "fpga": 0.0}
        self.concurrency = {"gpu": 1, "fpga": 1}

    # ---- calibration --------------------------------------------------------------
    def set_base_samples(self, samples: list[dict]) -> None:
        with self._lock:
            self._base = list(samples)
            self.model = CostModel.fit(self._base + list(self._online))

    def observe(self, samples: list[dict]) -> None:
        """Timings of a finished request, as samples; refits every few requests."""
        with self._lock:
            self._online.extend(samples)
            self._since_fit += 1
            if self._since_fit >= self._refit_every:
                self._since_fit = 0
                self.model = CostModel.fit(self._base + list(self._online))

    # ---- queueing -------------------------------------------------------------------
    def started(self, mode: str) -> None:
        with self._lock:
            for e in MODES[mode].engines:
                self._busy[e] += 1

    def finished(self, mode: str, seconds: float) -> None:
        with self._lock:
            for e in MODES[mode].engines:
                self._busy[e] = max(0, self._busy[e] - 1)
                self._mean_latency[e] = seconds if not self._mean_latency[e] else \
                    0.8 * self._mean_latency[e] + 0.2 * seconds

    def queueing(self, mode: str) -> float:
        return max(self._busy[e] * self._mean_latency[e] / max(1, self.concurrency[e]) for e in MODES[mode].engines)

    # ---- decisions ------------------------------------------------------------------
    def estimates(self, n_in: int, n_out: int, modes=MODE_NAMES) -> dict[str, float]:
        model = self.model
        return {m: model.estimate(m, n_in, n_out) + self.queueing(m) for m in modes if model.can_estimate(m)}

    def choose(self, n_in: int, n_out: int, forced: str | None = None, available=MODE_NAMES) -> Decision:
        """The mode to run. `available`: modes whose engines are up and can hold the request."""
        available = [m for m in MODE_NAMES if m in available]
        est = self.estimates(n_in, n_out, available)
        if forced is not None:
            return Decision(forced, "forced", est)
        if not available:
            raise LookupError("no engine is able to serve this request")
        reason = "auto" if len(available) == len(MODE_NAMES) else "fallback"
        if not est:  # not calibrated yet: the one device that does both stages fastest by design
            return Decision("hybrid" if "hybrid" in available else available[0], reason, est)
        return Decision(min(est, key=est.get), reason, est)


def samples_from_timings(mode: str, n_in: int, t: dict) -> list[dict]:
    """A finished request's timings as calibration samples."""
    out = [{"stage": "prefill", "device": MODES[mode].prefill_engine, "n_in": n_in, "seconds": t["prefill_s"]}]
    if t.get("decode_tokens"):
        out.append({"stage": "decode", "device": MODES[mode].decode_engine, "n_in": n_in, "n_out": t["decode_tokens"],
                    "seconds": t["decode_s"]})
    if mode == "hybrid":
        out.append({"stage": "handoff", "n_in": n_in, "seconds": t["handoff_exposed_s"]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m services.gateway.router",
                                 description="Which mode the router picks for one request, and why.")
    ap.add_argument("--calibration", required=True, help="JSON list of stage-timing samples")
    ap.add_argument("--n-in", type=int, required=True)
    ap.add_argument("--n-out", type=int, required=True)
    args = ap.parse_args(argv)
    try:
        with open(args.calibration) as f:
            samples = json.load(f)
        if not isinstance(samples, list):
            raise ValueError("the calibration file must hold a JSON list of samples")
        router = Router(samples)
        d = router.choose(args.n_in, args.n_out)
    except (OSError, ValueError, KeyError, LookupError) as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"mode": d.mode, "estimates": d.estimates}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
