"""`hybridserve up --autoscale`: engines of the pools started and stopped on the gateway's planner.

Every `interval_s` `up` reads `GET /debug/planner` from its gateway (the demand, the targets and the
replicas they need, and each pool's engines with the calls open on them) and lets each pool's
PoolScaler (autoscale.py: bounds, holds, cooldown) decide. Each step and its numbers are logged.

* Start: the next free index of the pool is started as a child of the supervisor (so it is healed like
  the others), on its ports a stride further, and joins the gateway's pool (`POST /admin/pools/{pool}/add`)
  only once its gRPC health answers: the gateway never routes to an engine still loading its model.
  A step up while an engine of the pool drains takes that one back instead.
* Stop: the highest index started by the scaler (never one of the minimum, which decode engines
  follow) is drained first (`.../drain`: the gateway sends it nothing new; its streams run on). Once
  the gateway has no call open on it, it leaves the pool (`.../remove`) and its process is stopped
  (SIGTERM: its ports and, for a prefill engine, its KV arena are freed). Past `drain_timeout_s` it is
  removed anyway and its calls are migrated like a lost engine's. An engine still starting is stopped
  at once.
* A gateway started again knows only the pools of its settings: each round, an engine the scaler
  started that the gateway does not list joins it again.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from prometheus_client import Counter, Gauge

from services.launcher.autoscale import Hysteresis, PoolScaler
from services.launcher.supervisor import ChildSpec, Supervisor

POOLS = ("prefill", "decode")

POOL_ENGINES = Gauge("hybridserve_up_pool_engines", "Engines of each pool `up --autoscale` runs, by state",
                ["pool", "state"])
STEPS = Counter("hybridserve_up_scale_steps", "Engines `up --autoscale` started (up) or drained (down)",
                ["pool", "direction"])


def observed(plan: dict, pool: str) -> str:
    """The pool's observed latencies and the floor they set, as the planner says (older gateways: "")."""
    r = plan.get("latency", {}).get(pool)
    if not r:
        return ""
    p50 = ", ".join(f"{k.upper()} p50 {r[f'{k}_p50_s']:.3g} s" for k in ("ttft", "itl") if r[f"{k}_p50_s"] is not None)
    return f"; observed {p50 or 'too few samples'}, model {plan['model'][pool]}, latency floor {r['floor']}"


class GatewayAdmin:
    """The gateway's planner and pool routes over HTTP (loopback; the API key when one is set)."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float = 5.0):
        self.url, self.timeout_s = url, timeout_s
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {api_key}"} if api_key else {})}

    def get(self, path: str) -> dict:
        return self._call(urllib.request.Request(self.url + path, headers=self.headers))

    def post(self, path: str, body: dict) -> dict:
        return self._call(urllib.request.Request(self.url + path, json.dumps(body).encode(), self.headers))

    def _call(self, request: urllib.request.Request) -> dict:
        with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
            return json.load(r)


@dataclass
class ScaledEngine:
    """An engine the scaler started (one above its pool's minimum)."""

    pool: str
    index: int
    spec: ChildSpec
    address: str
    ready: Callable[[], bool]  # its gRPC health answers SERVING
    state: str = "starting"  # "starting" → "serving" (in the gateway's pool) → "draining" → gone
    since: float = 0.0  # when it entered its state


SpecOf = Callable[[str, int], tuple[ChildSpec, str, Callable[[], bool]]]


class EngineAutoscaler:
    """`round()` from `up`'s supervision loop (it does its work every `interval_s`)."""

    def __init__(self, sup: Supervisor, spec_of: SpecOf, bounds: dict[str, tuple[int, int]],
                 hysteresis: Hysteresis, gateway: GatewayAdmin, say: Callable[[str], None],
                 interval_s: float = 5.0, drain_timeout_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.sup, self.spec_of, self.bounds, self.gateway, self.say = sup, spec_of, bounds, gateway, say
        self.interval_s, self.drain_timeout_s, self._clock = interval_s, drain_timeout_s, clock
        self.scalers = {pool: PoolScaler(pool, lo, hi, hysteresis, clock) for pool, (lo, hi) in bounds.items()}
        self.engines: dict[str, dict[int, ScaledEngine]] = {pool: {} for pool in bounds}
        self._said: dict[str, tuple] = {}
        self._next = 0.0

    def round(self) -> None:
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self.interval_s
        try:
            plan = self.gateway.get("/debug/planner")
        except (OSError, ValueError) as exc:  # the gateway is away (being started again): next round
            self._say_once("gateway", f"autoscale: no planner from the gateway ({exc}); waiting")
            return
        for pool in self.bounds:
            members = {m["address"]: m for m in plan["pools"][pool]}
            try:
                self._progress(pool, members, now)
                if plan.get("calibrated"):  # before, the planner has no costs: it says 1 whatever the load
                    self._decide(pool, plan, now)
            except (OSError, ValueError) as exc:
                self.say(f"autoscale {pool}: the gateway did not take a pool change ({exc}); trying again")
        for pool, engines in self.engines.items():
            for state in ("starting", "serving", "draining"):
                POOL_ENGINES.labels(pool=pool, state=state).set(self.bounds[pool][0] * (state == "serving") + sum(
                    e.state == state for e in engines.values()))

    # ---- the engines' states ---------------------------------------------------------------------
    def _progress(self, pool: str, members: dict[str, dict], now: float) -> None:
        for e in list(self.engines[pool].values()):
            member = members.get(e.address)
            if e.state == "starting" and e.ready():
                pairs = self.gateway.post(f"/admin/pools/{pool}/add", {"address": e.address})["pairs"]
                self._enter(e, "serving", now)
                self.say(f"autoscale {pool}: {e.spec.name} at {e.address} is ready and joined the pool "
                         f"(the gateway's pairs {pairs})")
            elif e.state == "serving" and member is None:
                self.gateway.post(f"/admin/pools/{pool}/add", {"address": e.address})
                self.say(f"autoscale {pool}: the gateway did not list {e.spec.name} (started again?); it joined again")
            elif e.state == "draining":
                calls = member["calls_open"] if member else 0
                late = now - e.since > self.drain_timeout_s
                if calls and not late:
                    continue
                if member is not None:
                    self.gateway.post(f"/admin/pools/{pool}/remove", {"address": e.address, "force": late})
                self.sup.remove(e.spec.name)
                del self.engines[pool][e.index]
                how = (f"drain timed out after {self.drain_timeout_s:g} s with {calls} call(s) open (migrated)"
                       if late else f"drained in {now - e.since:.1f} s")
                self.say(f"autoscale {pool}: {e.spec.name} at {e.address} stopped; {how}")

    def _enter(self, e: ScaledEngine, state: str, now: float) -> None:
        e.state, e.since = state, now

    # ---- the decisions ---------------------------------------------------------------------------
    def _decide(self, pool: str, plan: dict, now: float) -> None:
        lo, _ = self.bounds[pool]
        engines = self.engines[pool]
        current = lo + sum(e.state in ("starting", "serving") for e in engines.values())
        d = self.scalers[pool].decide(int(plan["desired"][pool]), current)
        dm, t = plan["demand"], plan["targets"]
        numbers = (f"planner: desired {d.desired}, target {d.target} within [{lo}, {self.bounds[pool][1]}], "
                   f"current {d.current}; demand {dm['requests_per_s']:.2f} req/s, prompt {dm['mean_prompt_tokens']:.0f} "
                   f"and output {dm['mean_output_tokens']:.0f} tokens on average over {t['window_s']:g} s; "
                   f"targets TTFT {t['ttft_s']:g} s, ITL {t['itl_s']:g} s{observed(plan, pool)}")
        if d.step == 0:
            # a hold or a cooldown is logged when it starts, not every round
            self._say_once(pool, f"autoscale {pool}: no change ({d.why}); {numbers}", key=(d.target, d.current))
            return
        if d.step > 0:
            action = self._step_up(pool, now)
        else:
            action = self._step_down(pool, now)
        STEPS.labels(pool=pool, direction="up" if d.step > 0 else "down").inc()
        self.say(f"autoscale {pool}: {action} ({d.why}); {numbers}")
        self._said.pop(pool, None)

    def _step_up(self, pool: str, now: float) -> str:
        draining = [e for e in self.engines[pool].values() if e.state == "draining"]
        if draining:
            e = max(draining, key=lambda e: e.index)
            self.gateway.post(f"/admin/pools/{pool}/add", {"address": e.address})
            self._enter(e, "serving", now)
            return f"{e.spec.name} at {e.address} serves again instead of draining"
        lo, hi = self.bounds[pool]
        index = next(i for i in range(lo, hi) if i not in self.engines[pool])
        spec, address, ready = self.spec_of(pool, index)
        self.engines[pool][index] = e = ScaledEngine(pool, index, spec, address, ready, since=now)
        self.sup.add(spec)
        return f"starting {spec.name} at {address}"

    def _step_down(self, pool: str, now: float) -> str:
        active = [e for e in self.engines[pool].values() if e.state in ("starting", "serving")]
        starting = [e for e in active if e.state == "starting"]
        e = max(starting or active, key=lambda e: e.index)
        if e.state == "starting":  # not in the gateway's pool yet: nothing to drain
            self.sup.remove(e.spec.name)
            del self.engines[pool][e.index]
            return f"stopped {e.spec.name} at {e.address} before it served"
        self.gateway.post(f"/admin/pools/{pool}/drain", {"address": e.address})
        self._enter(e, "draining", now)
        return f"draining {e.spec.name} at {e.address}, then stopping it"

    def _say_once(self, topic: str, text: str, key: tuple | None = None) -> None:
        key = key if key is not None else (text,)
        if self._said.get(topic) != key:
            self._said[topic] = key
            self.say(text)
