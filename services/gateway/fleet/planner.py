"""How many prefill and decode engines a TTFT and an ITL target need at the load of the last minute.

The signal a pool autoscaler follows (`hybridserve_planner_desired_replicas{pool}` on the gateway's
/metrics; deploy/k8s's split overlay scales its prefill and decode StatefulSets on it): NVIDIA
Dynamo's planner sizes its pools from SLOs the same way, where an HPA on queue depth only reacts
once requests already wait.

Demand: requests the gateway admitted in the last `window_s` seconds: their rate and mean prompt and
output lengths. Costs: the router's own fitted stages (the engines' profiles corrected by every
finished request): a prefill of the mean prompt on prefill_gpu, and a decode token on decode_fpga
beside `b - 1` others (the router's batch slowdown). The pools are sized as the disaggregated
(hybrid) layout runs: every prompt through the prefill pool, every output token through the decode pool.

* prefill: the least N for which the mean prompt's TTFT, its prefill time s over (1 - rho) with
  rho = rate x s / N (an M/M/1 queue per engine), stays within the TTFT target;
* decode: the least N for which the batch each engine carries, b = rate x n_out x itl(b) / N
  (Little's law, solved by iteration), fits its max_num_seqs and decodes within the ITL target.

Both are clamped to [1, max_replicas]; with no traffic, 1. The numbers are a model's, not a
promise, and a closed loop of clients or a busy host can leave the model far off (issue 59: sixteen
clients missed both targets while it said one pair). So the TTFT and ITL the gateway measured set a
floor per pool (planner_latency.py): a pool whose observed p50 misses its target asks for more
engines whatever the model says. `desired` is the larger of the two. Beside them, as NVIDIA Dynamo's
planner reports, each pool's correction: its observed p50 over what the model predicts at its present
size (TTFT for prefill, ITL for decode), the model's error in one number.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from services.gateway.fleet.planner_latency import POOLS, LatencyFloor, Observed, Reading


@dataclass(frozen=True)
class Targets:
    ttft_s: float = 2.0
    itl_s: float = 0.1
    max_replicas: int = 16
    window_s: float = 60.0
    min_samples: int = 5  # first tokens (or gaps) a pool's observed p50 needs before it counts
    headroom: float = 0.8  # a pool shrinks only to a size whose p50 would stay within this share of its target


@dataclass(frozen=True)
class Demand:
    rate: float  # requests per second
    n_in: float  # mean prompt tokens
    n_out: float  # mean output tokens


def predicted_ttft(d: Demand, prefill_s: float, n: int) -> float:
    """The model's TTFT of the mean prompt with n prefill engines (an M/M/1 queue each); inf when saturated."""
    rho = d.rate * prefill_s / n
    return prefill_s / (1 - rho) if rho < 1 else math.inf


def prefill_replicas(d: Demand, prefill_s: float, t: Targets) -> int:
    if d.rate <= 0:
        return 1
    for n in range(1, t.max_replicas + 1):
        if predicted_ttft(d, prefill_s, n) <= t.ttft_s:
            return n
    return t.max_replicas


def decode_batch(d: Demand, token_s: Callable[[int], float], n: int, max_num_seqs: int) -> int:
    """The batch each of n decode engines carries: b = rate x n_out x itl(b) / n (Little's law), a fixed
    point reached from below (cut off well past max_num_seqs: it does not fit anyway)."""
    batch = 1.0
    for _ in range(50):
        nxt = max(1.0, d.rate * d.n_out * token_s(math.ceil(batch)) / n)
        if abs(nxt - batch) < 0.01 or nxt > 10 * max_num_seqs:
            batch = nxt
            break
        batch = nxt
    return math.ceil(batch)


def decode_replicas(d: Demand, token_s: Callable[[int], float], max_num_seqs: int, t: Targets) -> int:
    """`token_s(b)`: seconds per output token of one request in a batch of b."""
    if d.rate <= 0:
        return 1
    for n in range(1, t.max_replicas + 1):
        b = decode_batch(d, token_s, n, max_num_seqs)
        if b <= max_num_seqs and token_s(b) <= t.itl_s:
            return n
    return t.max_replicas


@dataclass(frozen=True)
class Plan:
    """One evaluation: the model's counts, the latency floors, and the larger of the two per pool."""

    demand: Demand
    model: dict[str, int]  # the capacity model's, its costs scaled down by a correction below 1
    latency: dict[str, Reading]
    predicted: dict[str, float | None]  # the model's TTFT and ITL at the pools' present sizes
    correction: dict[str, float | None]  # observed p50 over predicted: prefill on TTFT, decode on ITL
    desired: dict[str, int]


class Planner:
    """Demand and latencies seen by this gateway, and the replicas the targets need; thread-safe."""

    def __init__(self, targets: Targets, clock: Callable[[], float] = time.monotonic):
        self.targets, self._clock = targets, clock
        self._lock = threading.Lock()
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, max output tokens)
        self.observed = Observed()
        self.floor = LatencyFloor(self.observed, targets.min_samples, targets.headroom)

    def arrived(self, n_in: int, n_out: int) -> None:
        with self._lock:
            self._arrivals.append((self._clock(), n_in, n_out))

    def observe(self, kind: str, mode: str, seconds: float) -> None:
        """A first token's TTFT (`kind` "ttft") or an inter-token gap ("itl") of a request in `mode`."""
        self.observed.add(kind, mode, seconds, self._clock())

    def demand(self) -> Demand:
        with self._lock:
            horizon = self._clock() - self.targets.window_s
            while self._arrivals and self._arrivals[0][0] < horizon:
                self._arrivals.popleft()
            n = len(self._arrivals)
            if n == 0:
                return Demand(0.0, 0.0, 0.0)
            return Demand(n / self.targets.window_s, sum(a[1] for a in self._arrivals) / n,
                          sum(a[2] for a in self._arrivals) / n)

    def plan(self, router, max_num_seqs: int, sizes: dict[str, int] | None = None) -> Plan:
        """The pools' sizes from the router's fitted costs (1 each before it is calibrated), raised to the
        observed latencies' floor. `sizes`: each pool's serving engines now (1 each when not given).

        A correction below 1 (the pool is faster than the model predicts: costs profiled on a busy host,
        or corrected by requests that ran beside others) scales the model's costs down before it sizes;
        one above 1 is left to the floor, which sizes on the pool as it is (docs/planner.md: scaled up,
        this model's costs would send every miss to max_replicas)."""
        d, t = self.demand(), self.targets
        sizes = {p: max(1, (sizes or {}).get(p, 1)) for p in POOLS}
        now, traffic = self._clock(), d.rate > 0
        targets = {"ttft": t.ttft_s, "itl": t.itl_s}
        latency = {p: self.floor.update(p, sizes[p], targets, now, t.window_s, traffic) for p in POOLS}
        model = {"prefill": 1, "decode": 1}
        predicted: dict[str, float | None] = {"ttft_s": None, "itl_s": None}
        correction: dict[str, float | None] = {"prefill": None, "decode": None}
        if router.calibrated and d.rate > 0:
            n_in, n_out = max(1, round(d.n_in)), max(1, round(d.n_out))
            prefill_s = router.stage_seconds("prefill", "gpu", n_in, 0)
            scale = {"decode": 1.0}

            def token_s(b: int) -> float:
                return scale["decode"] * router.stage_seconds("decode", "fpga", n_in, n_out, company=b - 1) / n_out
            seqs = max(1, max_num_seqs)
            predicted = {"ttft_s": predicted_ttft(d, prefill_s, sizes["prefill"]),
                         "itl_s": token_s(decode_batch(d, token_s, sizes["decode"], seqs))}
            # a model that saturates the pool it has (rho >= 1: costs profiled on a busy host, say) predicts no
            # finite TTFT; the pool's observed TTFT is then set against the prefill time alone
            ttft_model = predicted["ttft_s"] if math.isfinite(predicted["ttft_s"]) else prefill_s
            correction = {"prefill": _ratio(latency["prefill"].p50["ttft"], ttft_model),
                          "decode": _ratio(latency["decode"].p50["itl"], predicted["itl_s"])}
            prefill_s *= min(1.0, correction["prefill"] or 1.0)
            scale["decode"] = min(1.0, correction["decode"] or 1.0)
            model = {"prefill": prefill_replicas(d, prefill_s, t), "decode": decode_replicas(d, token_s, seqs, t)}
        desired = {p: min(t.max_replicas, max(model[p], latency[p].floor)) for p in POOLS}
        return Plan(d, model, latency, predicted, correction, desired)

    def desired(self, router, max_num_seqs: int, sizes: dict[str, int] | None = None) -> dict[str, int]:
        """{"prefill": N, "decode": M}: `plan(...).desired`."""
        return self.plan(router, max_num_seqs, sizes).desired


def _ratio(observed: float | None, predicted: float | None) -> float | None:
    if observed is None or predicted is None or not 0 < predicted < math.inf:
        return None
    return observed / predicted


def max_num_seqs(pairs) -> int:
    """decode_fpga's batch, as its Info says (pairs are alike); 1 before any Info."""
    return max((c.info["fpga"].max_num_seqs for c in pairs.members.values() if "fpga" in c.info), default=1)


def pool_sizes(pairs) -> dict[str, int]:
    """Each pool's engines the gateway routes to now (draining ones not counted; at least 1)."""
    out = {}
    for side, pool in enumerate(POOLS):
        engines = [a for a in pairs.pool(side) if (side, a) not in pairs.draining] if pairs.addresses else []
        out[pool] = max(1, len(engines) if pairs.addresses else len(pairs.members))
    return out


def snapshot(planner: Planner, router, pairs) -> dict:
    """`GET /debug/planner`: the demand, the targets, the model's counts, the observed latencies and their
    floors, the correction, and the replicas wanted, as the gauges say (what `hybridserve up
    --autoscale` reads, and logs beside each decision)."""
    return plan_json(planner.plan(router, max_num_seqs(pairs), pool_sizes(pairs)), planner.targets,
                     bool(router.calibrated))


def plan_json(plan: Plan, t: Targets, calibrated: bool) -> dict:
    d = plan.demand
    return {"desired": plan.desired, "model": plan.model,
            "latency": {p: {"engines": r.engines, "ttft_p50_s": r.p50["ttft"], "itl_p50_s": r.p50["itl"],
                            "ttft_samples": r.samples["ttft"], "itl_samples": r.samples["itl"],
                            "ratio": r.ratio, "floor": r.floor, "why": r.why} for p, r in plan.latency.items()},
            "predicted": {k: (v if v is None or v < math.inf else None) for k, v in plan.predicted.items()},
            "correction": plan.correction,
            "demand": {"requests_per_s": d.rate, "mean_prompt_tokens": d.n_in, "mean_output_tokens": d.n_out},
            "targets": {"ttft_s": t.ttft_s, "itl_s": t.itl_s, "max_replicas": t.max_replicas,
                        "window_s": t.window_s, "min_samples": t.min_samples, "headroom": t.headroom},
            "calibrated": calibrated}


def publish(planner: Planner, router, pairs) -> None:
    """The planner's figures as gauges computed at each scrape of the gateway's /metrics (one evaluation
    per scrape: the gauges share a plan for a second)."""
    from services.gateway import metrics as m

    cache: list = [None, -math.inf]

    def plan() -> Plan:
        now = time.monotonic()
        if now - cache[1] > 1.0:
            cache[:] = [planner.plan(router, max_num_seqs(pairs), pool_sizes(pairs)), now]
        return cache[0]

    def nan(x: float | None) -> float:
        return math.nan if x is None else x

    for pool in POOLS:
        m.PLANNER_DESIRED.labels(pool=pool).set_function(lambda pool=pool: plan().desired[pool])
        m.PLANNER_MODEL.labels(pool=pool).set_function(lambda pool=pool: plan().model[pool])
        m.PLANNER_FLOOR.labels(pool=pool).set_function(lambda pool=pool: plan().latency[pool].floor)
        m.PLANNER_RATIO.labels(pool=pool).set_function(lambda pool=pool: nan(plan().latency[pool].ratio))
        m.PLANNER_CORRECTION.labels(pool=pool).set_function(lambda pool=pool: nan(plan().correction[pool]))
        for kind in ("ttft", "itl"):
            m.PLANNER_OBSERVED.labels(pool=pool, latency=kind).set_function(
                lambda pool=pool, kind=kind: nan(plan().latency[pool].p50[kind]))
    m.PLANNER_DEMAND.set_function(lambda: plan().demand.rate)
    m.PLANNER_TARGET.labels(latency="ttft").set(planner.targets.ttft_s)
    m.PLANNER_TARGET.labels(latency="itl").set(planner.targets.itl_s)
