"""The router's cost model: physical, non-negative stage costs fitted to timing samples.

    prefill(dev, n)            = a + b n + c n^2        seconds for an n-token prompt
    decode per token(dev, ctx) = d + e ctx              ctx = n_in + n_out / 2, the mean context
    handoff(n)                 = h0 + h1 n              exposed seconds, hybrid only

Every coefficient is >= 0 (non-negative least squares): a slope can only add time, so a
fit can never make a longer prompt cheaper or predict a negative time. Samples are first
reduced to one median per measured point (so one slow repeat does not bend the curve),
then fitted in relative terms (each point weighs by 1/its time: the short prompts the
router sees most are fitted as well as the long ones). A prediction never falls below a
floor: a fraction of the cheapest measured time per unit (per prompt token for prefill and
hand-off, per token for decode) times the request's units, so it is never zero.

Samples: `{"stage", "device", "n_in", "n_out", "seconds"}`, decode seconds = the total
for n_out tokens, as the engines' Profile and the gateway's finished requests give them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from services.modes import MODES

FLOOR_FRACTION = 0.25  # a prediction is at least this share of the cheapest measured time per unit
TERMS = {"prefill": ("a", "b", "c"), "decode": ("d", "e"), "handoff": ("h0", "h1")}

StageKey = tuple[str, str]  # (stage, device); the hand-off's device is "link"


def stage_key(sample: dict) -> StageKey | None:
    """The (stage, device) a sample measures, or None for a sample the model does not use."""
    stage = sample.get("stage")
    if stage == "handoff":
        return ("handoff", "link")
    if stage in ("prefill", "decode") and sample.get("device"):
        if stage == "decode" and not sample.get("n_out"):
            return None
        return (stage, sample["device"])
    return None


def features(stage: str, n_in: float, n_out: float = 0.0) -> list[float]:
    """The cost terms of one point; the fit finds one coefficient per term."""
    if stage == "prefill":
        return [1.0, n_in, n_in * n_in]
    if stage == "decode":
        return [1.0, n_in + n_out / 2]
    return [1.0, n_in]


def units(stage: str, n_in: float) -> float:
    """What a stage's floor scales with: prompt tokens (prefill, hand-off); decode is per token already."""
    return 1.0 if stage == "decode" else max(1.0, n_in)


def unit_seconds(sample: dict) -> float:
    """What the model predicts for a sample: seconds, or seconds per token for decode."""
    if sample["stage"] == "decode":
        return float(sample["seconds"]) / float(sample["n_out"])
    return float(sample["seconds"])


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0, for the few (<= 3) columns a cost curve has.

    The optimum is the unconstrained least-squares solution on some subset of the columns
    (its support) with every coefficient >= 0; with k <= 3 columns all 2^k subsets are
    tried and the feasible one with the smallest residual is kept. Exact, and no scipy.
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.ndim != 2 or a.shape[0] != b.shape[0] or a.shape[1] > 4:
        raise ValueError(f"nnls: a {a.shape} and b {b.shape} do not fit")
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)  # columns span 1 .. n^2: scale for conditioning
    a_s = a / scale
    best, best_res = np.zeros(a.shape[1]), float(np.sum(b * b))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            sub, *_ = np.linalg.lstsq(a_s[:, cols], b, rcond=None)
            if np.any(sub < 0):
                continue
            x = np.zeros(a.shape[1])
            x[list(cols)] = sub
            res = float(np.sum((a_s @ x - b) ** 2))
            if res < best_res - 1e-15 * max(1.0, best_res):
                best, best_res = x, res
    return best / scale


@dataclass(frozen=True)
class StageFit:
    """One stage's coefficients (seconds; decode: seconds per token) and its floor."""

    stage: str
    coef: tuple[float, ...]
    floor_per_unit: float  # seconds per unit (see `units`), > 0
    points: int  # distinct measured points behind the fit

    def predict(self, n_in: float, n_out: float = 0.0) -> float:
        """Seconds (decode: per token), never below the floor."""
        raw = float(np.dot(self.coef, features(self.stage, n_in, n_out)))
        return max(raw, self.floor_per_unit * units(self.stage, n_in))

    def as_json(self) -> dict:
        return {**dict(zip(TERMS[self.stage], self.coef)), "floor_per_unit": self.floor_per_unit,
                "points": self.points}


def fit_stage(stage: str, samples: list[dict], weights: list[float] | None = None) -> StageFit:
    """NNLS over the per-point medians of one stage's samples (all of one device)."""
    weights = weights or [1.0] * len(samples)
    points: dict[tuple, list[tuple[float, float]]] = {}
    for s, w in zip(samples, weights):
        n_out = float(s.get("n_out") or 0) if stage == "decode" else 0.0
        points.setdefault((float(s["n_in"]), n_out), []).append((unit_seconds(s), w))
    xs, ys, ws, per_unit = [], [], [], []
    for (n_in, n_out), vals in points.items():
        ys.append(max(float(np.median([v for v, _ in vals])), 1e-9))
        per_unit.append(ys[-1] / units(stage, n_in))
        ws.append(sum(w for _, w in vals))
        xs.append(features(stage, n_in, n_out))
    y = np.asarray(ys)
    # one coefficient per distinct point at most: two points cannot pin a curve's bend
    n_terms = min(len(TERMS[stage]), len({tuple(x[1:]) for x in xs}))
    x = np.asarray(xs)[:, :max(1, n_terms)]
    row_w = np.sqrt(np.asarray(ws)) / y  # relative error, times the points' weights
    coef = nnls(x * row_w[:, None], y * row_w)
    full = tuple(float(c) for c in coef) + (0.0,) * (len(TERMS[stage]) - len(coef))
    return StageFit(stage, full, FLOOR_FRACTION * min(per_unit), len(ys))


@dataclass
class CostModel:
    """A `StageFit` per (stage, device); `fit` builds them from samples."""

    stages: dict[StageKey, StageFit] = field(default_factory=dict)

    @classmethod
    def fit(cls, samples: list[dict], weights: list[float] | None = None) -> "CostModel":
        weights = weights or [1.0] * len(samples)
        by_key: dict[StageKey, tuple[list, list]] = {}
        for s, w in zip(samples, weights):
            key = stage_key(s)
            if key is not None and float(s.get("seconds", 0)) > 0:
                group = by_key.setdefault(key, ([], []))
                group[0].append(s)
                group[1].append(w)
        return cls({key: fit_stage(key[0], ss, ws) for key, (ss, ws) in by_key.items()})

    @staticmethod
    def stage_keys(mode: str) -> list[StageKey]:
        """The stages a mode runs, in order."""
        m = MODES[mode]
        keys = [("prefill", m.prefill_engine)]
        if m.prefill_engine != m.decode_engine:
            keys.append(("handoff", "link"))
        return keys + [("decode", m.decode_engine)]

    def can_estimate(self, mode: str) -> bool:
        return all(k in self.stages for k in self.stage_keys(mode))

    def stage_seconds(self, key: StageKey, n_in: int, n_out: int) -> float:
        """Seconds the stage takes for the request (decode: all n_out tokens)."""
        fit = self.stages[key]
        if key[0] == "decode":
            return n_out * fit.predict(n_in, n_out)
        return fit.predict(n_in)

    def estimate(self, mode: str, n_in: int, n_out: int) -> float:
        return sum(self.stage_seconds(k, n_in, n_out) for k in self.stage_keys(mode))

    def as_json(self) -> dict:
        return {f"{stage}/{dev}": fit.as_json() for (stage, dev), fit in sorted(self.stages.items())}
