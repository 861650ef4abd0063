"""The planner's observed-latency floor (services/gateway/fleet/planner_latency.py) through the real Planner and
the router's real fitted costs, on a hand-moved clock: a pool missing its target asks for more engines
whatever the capacity model says, one meeting it stays at the minimum, evidence from before a size
change is not counted, and under a steady load the answer does not oscillate (also with the real
PoolScaler of `up --autoscale` acting on it).

The live check (a real stack, default targets) is tests/gateway/test_api_planner.py.
"""
from __future__ import annotations

import math
import random

import pytest

from services.launcher.autoscale import Hysteresis, PoolScaler
from services.gateway.fleet.planner import Planner, Targets, plan_json
from services.gateway.fleet.planner_latency import floor_for, pool_of
from services.gateway.routing.router import Router
from tests.gateway.test_planner import calibrated_router


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def planner(**targets) -> tuple[Planner, Clock]:
    clock = Clock()
    return Planner(Targets(**targets), clock=clock), clock


def closed_loop_second(p: Planner, clock: Clock, ttft: float, itl: float, mode: str = "hybrid",
                       requests: int = 1, gaps: int = 20) -> None:
    """One second of a load: `requests` admitted (issue 59's mean prompt and output), each with its first
    token at `ttft` and `gaps` token gaps at `itl`; the clock moves on by a second."""
    for _ in range(requests):
        p.arrived(149, 145)
        p.observe("ttft", mode, ttft)
        for _ in range(gaps):
            p.observe("itl", mode, itl)
    clock.now += 1.0


def test_each_latency_is_charged_to_the_pool_whose_engine_measured_it():
    assert [pool_of("ttft", m) for m in ("gpu", "hybrid", "fpga")] == ["prefill", "prefill", "decode"]
    assert [pool_of("itl", m) for m in ("gpu", "hybrid", "fpga")] == ["prefill", "decode", "decode"]


def test_the_rule_asks_in_proportion_to_the_miss_and_shrinks_only_with_headroom():
    assert floor_for(1.87, 1, 0.8) == 2 and floor_for(1.01, 1, 0.8) == 2  # at least one more
    assert floor_for(2.5, 2, 0.8) == 5  # latency taken as inversely proportional to engines
    assert floor_for(0.9, 2, 0.8) == 2 and floor_for(0.5, 2, 0.8) == 2  # at 1 it would be 1.0: no room
    assert floor_for(0.39, 2, 0.8) == 1 and floor_for(0.3, 3, 0.8) == 2
    assert floor_for(0.1, 1, 0.8) == 1  # never below one


def test_issue_59s_closed_loop_misses_both_targets_and_both_pools_ask_for_more():
    """Sixteen clients: 0.38 requests/s of 149 prompt and 145 output tokens, TTFT p50 3.74 s and ITL p50
    167 ms against 2 s and 0.1 s. The capacity model (the router's costs) says one pair; the observed
    latencies raise both pools."""
    router = calibrated_router()
    p, clock = planner()
    for i in range(60):
        closed_loop_second(p, clock, ttft=3.74, itl=0.167, requests=int(i % 8 < 3))  # ~0.38/s
    plan = p.plan(router, 8)
    assert plan.demand.rate == pytest.approx(0.38, abs=0.03)
    assert plan.model == {"prefill": 1, "decode": 1}  # what today's planner answered
    assert plan.latency["prefill"].p50["ttft"] == pytest.approx(3.74)
    assert plan.latency["decode"].p50["itl"] == pytest.approx(0.167)
    assert plan.desired == {"prefill": 2, "decode": 2}  # ceil(1.87) and ceil(1.67)
    # the correction: observed over the model's own prediction at one engine each
    prefill_s = router.stage_seconds("prefill", "gpu", 149, 0)
    assert plan.predicted["ttft_s"] == pytest.approx(prefill_s / (1 - plan.demand.rate * prefill_s))
    assert plan.correction["prefill"] == pytest.approx(3.74 / plan.predicted["ttft_s"])
    assert plan.correction["decode"] == pytest.approx(0.167 / plan.predicted["itl_s"])
    shown = plan_json(plan, p.targets, True)
    assert shown["latency"]["decode"]["ratio"] == pytest.approx(1.67) and shown["latency"]["decode"]["floor"] == 2
    assert shown["model"] == {"prefill": 1, "decode": 1} and shown["desired"] == {"prefill": 2, "decode": 2}


def test_a_load_that_meets_the_targets_stays_at_the_minimum():
    router = calibrated_router()
    p, clock = planner()
    for _ in range(120):
        closed_loop_second(p, clock, ttft=0.6, itl=0.04)
        plan = p.plan(router, 8)
        assert plan.desired == {"prefill": 1, "decode": 1}, plan
    assert plan.latency["prefill"].ratio == pytest.approx(0.3) and plan.latency["decode"].ratio == pytest.approx(0.4)


def test_a_model_saturated_by_a_busy_hosts_profile_is_corrected_by_what_the_pool_does():
    """Prefill costs profiled beside other work (here 0.1 s a token: 14.9 s for the mean prompt) make the model
    saturate one engine at one request a second, an infinite predicted TTFT and once max_replicas engines. The
    pool meets the target (0.6 s observed), so the observed TTFT set against the prefill time alone scales
    the cost down and the pool stays at one (the live planner test once saw 16 this way)."""
    samples = []
    for n in (16, 64, 256):
        samples += [{"stage": "prefill", "device": d, "n_in": n, "n_out": 0, "seconds": 0.1 * n}
                    for d in ("gpu", "fpga")]
        samples += [{"stage": "decode", "device": d, "n_in": n, "n_out": 32, "seconds": 32 * 0.01}
                    for d in ("gpu", "fpga")]
        samples.append({"stage": "handoff", "n_in": n, "n_out": 0, "seconds": 0.0001 * n})
    router = Router(samples)
    p, clock = planner()
    for _ in range(30):
        closed_loop_second(p, clock, ttft=0.6, itl=0.04)
    plan = p.plan(router, 8)
    assert plan.predicted["ttft_s"] == float("inf")
    assert plan.correction["prefill"] == pytest.approx(0.6 / router.stage_seconds("prefill", "gpu", 149, 0))
    assert plan.desired == {"prefill": 1, "decode": 1}, plan


def test_fpga_mode_misses_raise_the_decode_pool_only():
    p, clock = planner()
    for _ in range(10):
        closed_loop_second(p, clock, ttft=5.0, itl=0.3, mode="fpga")
    assert p.desired(calibrated_router(), 8) == {"prefill": 1, "decode": 3}  # ceil(0.3 / 0.1), ceil(5 / 2)


def test_too_few_samples_set_no_floor_and_no_traffic_clears_it():
    p, clock = planner(min_samples=5)
    router = calibrated_router()
    for _ in range(4):
        closed_loop_second(p, clock, ttft=9.0, itl=0.01, gaps=0)
    assert p.plan(router, 8).latency["prefill"].floor == 0  # four first tokens: not yet evidence
    closed_loop_second(p, clock, ttft=9.0, itl=0.01, gaps=0)
    assert p.desired(router, 8)["prefill"] == 5  # ceil(9 / 2)
    clock.now += 61  # a window without a request: no demand, no latency, no floor
    plan = p.plan(router, 8)
    assert plan.desired == {"prefill": 1, "decode": 1} and plan.latency["prefill"].why == "no traffic in the window"


def test_only_latencies_since_the_pool_changed_size_count():
    router = calibrated_router()
    p, clock = planner(min_samples=5)
    for _ in range(30):
        closed_loop_second(p, clock, ttft=3.0, itl=0.05)
    assert p.desired(router, 8, {"prefill": 1, "decode": 1})["prefill"] == 2
    # the second engine joins: the misses of the last 30 s were of one engine; the ask stands meanwhile
    plan = p.plan(router, 8, {"prefill": 2, "decode": 1})
    assert plan.latency["prefill"].samples["ttft"] == 0 and plan.desired["prefill"] == 2
    for _ in range(4):
        closed_loop_second(p, clock, ttft=1.4, itl=0.05)
    assert p.plan(router, 8, {"prefill": 2, "decode": 1}).latency["prefill"].samples["ttft"] == 4
    closed_loop_second(p, clock, ttft=1.4, itl=0.05)
    plan = p.plan(router, 8, {"prefill": 2, "decode": 1})
    # p50 1.4 s of 2 s with two engines: one would give ~2.8 s, so the floor keeps two (not three: the
    # old misses would have said so)
    assert plan.latency["prefill"].p50["ttft"] == pytest.approx(1.4) and plan.desired["prefill"] == 2
    for _ in range(61):  # the load eases: 0.5 s at two engines, 1 s expected at one, within 0.8 x 2 s
        closed_loop_second(p, clock, ttft=0.5, itl=0.05)
    assert p.desired(router, 8, {"prefill": 2, "decode": 1})["prefill"] == 1


def test_an_ask_stands_while_the_p50_is_within_the_band_below_the_target():
    router = calibrated_router()
    p, clock = planner(headroom=0.8, window_s=10)
    for _ in range(10):
        closed_loop_second(p, clock, ttft=2.2, itl=0.05)
    assert p.desired(router, 8)["prefill"] == 2
    answers = []
    for _ in range(30):  # the p50 just under the target, one engine still: no flip back to 1
        closed_loop_second(p, clock, ttft=1.9, itl=0.05)
        answers.append(p.desired(router, 8)["prefill"])
    assert answers == [2] * 30
    for _ in range(12):  # well under (1.4 s: 0.7 of the target): the ask lapses
        closed_loop_second(p, clock, ttft=1.4, itl=0.05)
    assert p.desired(router, 8)["prefill"] == 1


@pytest.mark.parametrize("base_ttft, want", [(3.0, 2), (5.0, 3), (1.5, 1)])
def test_no_flapping_under_a_steady_load_with_the_autoscalers_holds(base_ttft, want):
    """A steady closed loop whose TTFT p50 is `base_ttft` at one prefill engine and inversely proportional
    to the engines serving (with 10% noise), a planner read every 5 s by the real PoolScaler (holds and
    cooldown), an engine joining 20 s after its start: the pool grows to what meets the target, one
    step at a time, never shrinks, and the planner's answer never goes down while the load is on."""
    rng = random.Random(7)
    router = calibrated_router()
    p, clock = planner()
    scaler = PoolScaler("prefill", 1, 4, Hysteresis(up_hold_s=30, down_hold_s=120, cooldown_s=60), clock)
    serving, starting = 1, []  # starting: when each engine started joins
    answers, sizes = [], []
    for second in range(900):
        ttft = base_ttft / serving * rng.uniform(0.9, 1.1)
        closed_loop_second(p, clock, ttft=ttft, itl=0.05, requests=2)
        serving += sum(1 for t in starting if t <= clock.now)
        starting = [t for t in starting if t > clock.now]
        if second % 5 == 0:
            desired = p.desired(router, 8, {"prefill": serving, "decode": 1})["prefill"]
            answers.append(desired)
            d = scaler.decide(desired, serving + len(starting))
            assert d.step >= 0, (second, d)
            if d.step > 0:
                starting.append(clock.now + 20)
            sizes.append(serving)
    assert serving == want and not starting
    assert all(b >= a for a, b in zip(answers, answers[1:])), answers  # no oscillation
    assert all(b >= a for a, b in zip(sizes, sizes[1:]))
    assert base_ttft / want <= 2.0  # what it grew to meets the target


def test_latencies_in_a_plan_are_json_and_nan_free():
    p, clock = planner()
    shown = plan_json(p.plan(calibrated_router(), 8), p.targets, True)
    assert shown["latency"]["prefill"]["ttft_p50_s"] is None and shown["correction"] == {"prefill": None,
                                                                                         "decode": None}
    assert shown["targets"]["min_samples"] == 5 and not any(
        isinstance(v, float) and math.isnan(v) for v in shown["targets"].values())


def test_a_model_that_overestimates_is_corrected_down_by_what_was_observed():
    """Costs profiled on a busy host: the model wants two prefill engines (its TTFT at one, 1.05 s, over
    a 1 s target) while one serves first tokens in 0.3 s. The correction (0.3 / 1.05) scales the model's
    prefill cost down, and the pool stays at one engine; without evidence the model's answer stands."""
    router = calibrated_router()
    p, clock = planner(ttft_s=1.0, window_s=30)
    for _ in range(30):  # a request of 256 prompt tokens a second: 0.512 s of prefill each
        p.arrived(256, 8)
        clock.now += 1.0
    assert p.plan(router, 8).model["prefill"] == 2  # no first token observed yet: the model alone
    for _ in range(30):
        p.arrived(256, 8)
        p.observe("ttft", "hybrid", 0.3)
        clock.now += 1.0
    plan = p.plan(router, 8)
    assert plan.predicted["ttft_s"] > 1.0 and plan.correction["prefill"] == pytest.approx(
        0.3 / plan.predicted["ttft_s"])
    assert plan.model["prefill"] == 1 and plan.desired["prefill"] == 1
