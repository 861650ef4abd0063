"""The SLO planner (services/gateway/fleet/planner.py): pool sizes from demand and the router's fitted costs.

The live export (the gauges on a running gateway's /metrics, through Prometheus) is covered by the
dashboard test in test_prometheus.py, whose panel queries hybridserve_planner_desired_replicas."""
from __future__ import annotations

import pytest

from services.gateway.fleet.planner import Demand, Planner, Targets, decode_replicas, prefill_replicas
from services.gateway.routing.router import Router


def test_prefill_pool_grows_until_the_queueing_ttft_meets_the_target():
    t = Targets(ttft_s=0.5)
    assert prefill_replicas(Demand(0.0, 100, 10), 0.1, t) == 1  # no traffic
    assert prefill_replicas(Demand(5.0, 100, 10), 0.1, t) == 1  # rho 0.5: 0.2 s
    # rate 20 x 0.1 s: one engine is saturated, two sit at rho 1, three at 0.67 (TTFT 0.3 s)
    assert prefill_replicas(Demand(20.0, 100, 10), 0.1, t) == 3
    assert prefill_replicas(Demand(20.0, 100, 10), 0.6, t) == t.max_replicas  # one prefill alone misses it


def test_decode_pool_holds_its_batch_within_the_itl_target():
    def token_s(b):  # 10 ms alone, 10% slower per companion
        return 0.01 * (1 + 0.1 * (b - 1))
    t = Targets(itl_s=0.02)
    # 10 req/s x 100 tokens: one engine's batch never settles; two carry 9 each at 18 ms a token
    assert decode_replicas(Demand(10.0, 50, 100), token_s, 16, t) == 2
    assert decode_replicas(Demand(10.0, 50, 100), token_s, 8, t) == 3  # a batch of 9 does not fit 8
    assert decode_replicas(Demand(10.0, 50, 100), token_s, 16, Targets(itl_s=0.005)) == t.max_replicas
    assert decode_replicas(Demand(0.0, 0, 0), token_s, 16, t) == 1


def test_demand_is_the_window_of_arrivals():
    now = [0.0]
    p = Planner(Targets(window_s=10.0), clock=lambda: now[0])
    for i in range(20):
        now[0] = i * 0.5
        p.arrived(100 + i, 50)
    d = p.demand()
    assert d.rate == pytest.approx(2.0) and d.n_in == pytest.approx(109.5) and d.n_out == 50
    now[0] = 30.0
    assert p.demand().rate == 0.0


def calibrated_router() -> Router:
    samples = []
    for n in (16, 64, 256):
        samples += [{"stage": "prefill", "device": d, "n_in": n, "n_out": 0, "seconds": s * n}
                    for d, s in (("gpu", 0.002), ("fpga", 0.004))]
        samples += [{"stage": "decode", "device": d, "n_in": n, "n_out": 32, "seconds": 32 * s}
                    for d, s in (("gpu", 0.05), ("fpga", 0.01))]
        samples.append({"stage": "handoff", "n_in": n, "n_out": 0, "seconds": 0.0001 * n})
    router = Router(samples)
    assert router.calibrated
    return router


def test_desired_replicas_follow_the_routers_costs_and_the_load():
    router = calibrated_router()
    now = [0.0]
    p = Planner(Targets(ttft_s=1.0, itl_s=0.05), clock=lambda: now[0])
    assert p.desired(router, 8) == {"prefill": 1, "decode": 1}
    for i in range(600):  # 10 requests a second of 256 prompt and 128 output tokens
        now[0] = i * 0.1
        p.arrived(256, 128)
    light = p.desired(router, 8)
    for i in range(600, 1800):  # then 30 a second
        now[0] = 60 + (i - 600) * (1 / 30)
        p.arrived(256, 128)
    heavy = p.desired(router, 8)
    assert heavy["decode"] > light["decode"] >= 1 and heavy["prefill"] >= light["prefill"] >= 1
    # the decode pool is what Little's law and the router's decode cost say: rate x n_out x itl(b) / N <= 8
    per_token = router.stage_seconds("decode", "fpga", 256, 128) / 128
    rate = p.demand().rate  # the last minute: 20 s of the light load and 40 s of the heavy one
    assert rate == pytest.approx((200 + 1200) / 60, rel=0.01)
    assert heavy["decode"] >= rate * 128 * per_token / 8 > heavy["decode"] - 1
