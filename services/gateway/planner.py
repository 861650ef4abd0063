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
promise: the figures that check them are the TTFT and ITL histograms on the same /metrics.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Targets:
    ttft_s: float = 2.0
    itl_s: float = 0.1
    max_replicas: int = 16
    window_s: float = 60.0


@dataclass(frozen=True)
class Demand:
    rate: float  # requests per second
    n_in: float  # mean prompt tokens
    n_out: float  # mean output tokens


def prefill_replicas(d: Demand, prefill_s: float, t: Targets) -> int:
    if d.rate <= 0:
        return 1
    for n in range(1, t.max_replicas + 1):
        rho = d.rate * prefill_s / n
        if rho < 1 and prefill_s / (1 - rho) <= t.ttft_s:
            return n
    return t.max_replicas


def decode_replicas(d: Demand, token_s: Callable[[int], float], max_num_seqs: int, t: Targets) -> int:
    """`token_s(b)`: seconds per output token of one request in a batch of b."""
    if d.rate <= 0:
        return 1
    for n in range(1, t.max_replicas + 1):
        batch = 1.0
        for _ in range(50):  # b = rate x n_out x itl(b) / n: a fixed point, reached from below
            nxt = max(1.0, d.rate * d.n_out * token_s(math.ceil(batch)) / n)
            if abs(nxt - batch) < 0.01 or nxt > 10 * max_num_seqs:
                batch = nxt
                break
            batch = nxt
        b = math.ceil(batch)
        if b <= max_num_seqs and token_s(b) <= t.itl_s:
            return n
    return t.max_replicas


class Planner:
    """Demand seen by this gateway, and the replicas the targets need; thread-safe."""

    def __init__(self, targets: Targets, clock: Callable[[], float] = time.monotonic):
        self.targets, self._clock = targets, clock
        self._lock = threading.Lock()
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, max output tokens)

    def arrived(self, n_in: int, n_out: int) -> None:
        with self._lock:
            self._arrivals.append((self._clock(), n_in, n_out))

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

    def desired(self, router, max_num_seqs: int) -> dict[str, int]:
        """{"prefill": N, "decode": M} from the router's fitted costs (1 each before it is calibrated)."""
        d = self.demand()
        if d.rate <= 0 or not router.calibrated:
            return {"prefill": 1, "decode": 1}
        n_in, n_out = max(1, round(d.n_in)), max(1, round(d.n_out))
        prefill_s = router.stage_seconds("prefill", "gpu", n_in, 0)

        def token_s(b: int) -> float:
            return router.stage_seconds("decode", "fpga", n_in, n_out, company=b - 1) / n_out
        return {"prefill": prefill_replicas(d, prefill_s, self.targets),
                "decode": decode_replicas(d, token_s, max(1, max_num_seqs), self.targets)}


def max_num_seqs(pairs) -> int:
    """decode_fpga's batch, as its Info says (pairs are alike); 1 before any Info."""
    return max((c.info["fpga"].max_num_seqs for c in pairs.members.values() if "fpga" in c.info), default=1)


def snapshot(planner: Planner, router, pairs) -> dict:
    """`GET /debug/planner`: the demand, the targets and the replicas they need, as the gauges say
    (what `hybridserve up --autoscale` reads, and logs beside each decision)."""
    d, t = planner.demand(), planner.targets
    return {"desired": planner.desired(router, max_num_seqs(pairs)),
            "demand": {"requests_per_s": d.rate, "mean_prompt_tokens": d.n_in, "mean_output_tokens": d.n_out},
            "targets": {"ttft_s": t.ttft_s, "itl_s": t.itl_s, "max_replicas": t.max_replicas,
                        "window_s": t.window_s},
            "calibrated": bool(router.calibrated)}


def publish(planner: Planner, router, pairs) -> None:
    """The planner's figures as gauges computed at each scrape of the gateway's /metrics."""
    from services.gateway import metrics as m

    for pool in ("prefill", "decode"):
        m.PLANNER_DESIRED.labels(pool=pool).set_function(
            lambda pool=pool: planner.desired(router, max_num_seqs(pairs))[pool])
    m.PLANNER_DEMAND.set_function(lambda: planner.demand().rate)
