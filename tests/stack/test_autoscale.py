"""`up --autoscale` without engines: the decision for one pool (services/launcher/autoscale.py) on a hand-moved
clock (bounds, the holds before a step, the cooldown after one, one engine per step, no flapping on a
jumpy planner), and acting on it (stack_autoscale.py) with a real supervisor of small child processes
and the gateway's real pool routes over fake engines, the planner's wish set by the test: an engine
joins the pool only once ready, a drained one is stopped only once its calls are over, a gateway
started again is told it again.
"""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from services.launcher.autoscale import Hysteresis, PoolScaler
from services.gateway.api.app import create_app
from services.gateway.fleet.pairs import Pairs
from services.gateway.settings import GatewaySettings
from services.launcher.stack import UpSettings
from services.launcher.stack_autoscale import EngineAutoscaler
from services.launcher.supervisor import ChildSpec, Supervisor
from tests.gateway.test_dispatch import FakeEngines

H = Hysteresis(up_hold_s=10, down_hold_s=30, cooldown_s=20)


class Clock:
    def __init__(self):
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def scaler(lo=1, hi=3) -> tuple[PoolScaler, Clock]:
    clock = Clock()
    return PoolScaler("decode", lo, hi, H, clock), clock


def run(s: PoolScaler, clock: Clock, desired: int, current: int, seconds: float, every: float = 1.0) -> list[int]:
    """`decide` every `every` s for `seconds`, the pool growing and shrinking as decided: the steps."""
    steps = []
    for _ in range(int(seconds / every)):
        d = s.decide(desired, current)
        if d.step:
            steps.append(d.step)
            current += d.step
        clock.now += every
    return steps


def test_a_step_up_waits_for_the_hold_then_one_engine_per_step_with_a_cooldown_between():
    s, clock = scaler(hi=3)
    steps, current = {}, 1
    for t in range(100):
        d = s.decide(16, current)
        if d.step:
            steps[t] = (d.step, d.target, d.desired)
            current += d.step
        clock.now += 1
    # held 10 s; the next one is held again from then (10 s), but the cooldown (20 s) is longer; then
    # the bound (3) stops it: the planner's 16 is clamped
    assert steps == {10: (1, 3, 16), 30: (1, 3, 16)}


def test_the_pool_never_leaves_its_bounds_whatever_the_planner_says():
    s, clock = scaler(lo=2, hi=3)
    assert run(s, clock, desired=16, current=2, seconds=200) == [1]  # 3 at most
    s, clock = scaler(lo=2, hi=3)
    assert run(s, clock, desired=1, current=3, seconds=200) == [-1]  # 2 at least
    assert s.decide(1, 2).why.startswith("at the target (at a bound)")


def test_going_down_holds_longer_than_going_up():
    s, clock = scaler()
    assert run(s, clock, desired=1, current=2, seconds=29) == []
    assert run(s, clock, desired=1, current=2, seconds=2) == [-1]


def test_a_planner_jumping_up_and_down_makes_no_step():
    s, clock = scaler()
    steps = []
    for i in range(300):  # a burst every other 5 s: the target never holds for the up hold of 10 s
        d = s.decide(3 if (i // 5) % 2 == 0 else 1, 2)
        steps += [d.step] if d.step else []
        clock.now += 1
    assert steps == []


def test_a_pool_outside_its_bounds_is_corrected_at_once():
    s, _ = scaler(lo=2, hi=3)
    assert s.decide(2, 1).step == 1 and s.decide(2, 4).step == -1


def test_bounds_must_hold_a_pool():
    with pytest.raises(ValueError, match="min <= max"):
        PoolScaler("prefill", 2, 1, H)


def test_up_settings_bound_autoscaling_by_the_pools_sizes():
    s = UpSettings(prefill_engines=1, decode_engines=2, autoscale=True, max_decode_engines=4)
    assert s.bounds() == {"prefill": (1, 1), "decode": (2, 4)}
    with pytest.raises(ValueError, match="below the decode pool's size"):
        UpSettings(decode_engines=3, autoscale=True, max_decode_engines=2)
    with pytest.raises(ValueError, match="autoscale, which is off"):
        UpSettings(decode_engines=1, max_decode_engines=2)
    with pytest.raises(ValueError, match="not pairs"):
        UpSettings(pairs=2, autoscale=True)


# ---- acting on the decisions ----------------------------------------------------------------------
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


class RoutedGateway:
    """What GatewayAdmin asks of the gateway, answered by the gateway app's own pool routes over fake
    engines; the planner's desired replicas are the test's."""

    def __init__(self):
        self.desired = {"prefill": 1, "decode": 1}
        self.app = create_app(GatewaySettings(prefill_pool="p:0", decode_pool="d:0", pool_admin=True))
        self.restart()
        self.client = TestClient(self.app, client=("127.0.0.1", 40000))

    def restart(self) -> None:
        """As a gateway started again: the pools of its settings only."""
        self.app.state.hs = SimpleNamespace(pairs=Pairs({0: FakeEngines()}, {0: ("p:0", "d:0")}, pools=True),
                                            connect=lambda address: FakeEngines())

    @property
    def pairs(self) -> Pairs:
        return self.app.state.hs.pairs

    def get(self, path: str) -> dict:
        assert path == "/debug/planner"
        return {"desired": dict(self.desired), "calibrated": True, "pools": self.client.get("/admin/pools").json(),
                "demand": {"requests_per_s": 3.0, "mean_prompt_tokens": 20.0, "mean_output_tokens": 8.0},
                "targets": {"ttft_s": 2.0, "itl_s": 0.1, "max_replicas": 16, "window_s": 60.0}}

    def post(self, path: str, body: dict) -> dict:
        r = self.client.post(path, json=body)
        if r.status_code != 200:
            raise OSError(f"{r.status_code} {r.text}")  # as urllib's HTTPError is
        return r.json()


@pytest.fixture
def scaled():
    gateway, said, ready = RoutedGateway(), [], {}
    sup = Supervisor([], lambda spec: subprocess.Popen(spec.argv), said.append)

    def spec_of(pool: str, index: int):
        name = f"{pool}.{index}"
        return ChildSpec(name, SLEEP, {}), f"{pool[0]}:{index}", lambda: ready.get(name, False)
    scaler = EngineAutoscaler(sup, spec_of, {"prefill": (1, 1), "decode": (1, 3)}, Hysteresis(0, 0, 0), gateway,
                              said.append, interval_s=0)
    yield scaler, gateway, sup, ready, said
    sup.stop_all(list(sup.children))


def test_a_started_engine_joins_once_ready_and_a_drained_one_stops_once_its_calls_end(scaled):
    scaler, gateway, sup, ready, said = scaled
    gateway.desired["decode"] = 2
    scaler.round()
    child = sup.children["decode.1"].proc
    assert child.poll() is None and gateway.pairs.pool(1) == ["d:0"]  # started, not yet in the pool
    scaler.round()
    assert gateway.pairs.pool(1) == ["d:0"]  # not ready: still out
    ready["decode.1"] = True
    scaler.round()
    assert gateway.pairs.pool(1) == ["d:0", "d:1"] and "decode.2" not in sup.children  # one engine per step
    assert any("starting decode.1 at d:1" in m and "desired 2, target 2 within [1, 3]" in m
               and "3.00 req/s" in m for m in said), said
    gateway.restart()  # a gateway started again forgets it: it is told again
    scaler.round()
    assert gateway.pairs.pool(1) == ["d:0", "d:1"]
    (pair,) = gateway.pairs.pairs_with(1, "d:1")
    gateway.pairs.loads.started(pair, "hybrid")  # a stream on it
    gateway.desired["decode"] = 1
    for _ in range(3):
        scaler.round()
    assert gateway.pairs.draining == {(1, "d:1")} and child.poll() is None  # drained, not stopped
    gateway.pairs.loads.finished(pair, "hybrid")
    scaler.round()
    assert gateway.pairs.pool(1) == ["d:0"] and "decode.1" not in sup.children
    assert child.wait(10) is not None
    assert any("decode.1 at d:1 stopped; drained in" in m for m in said), said


def test_the_bounds_hold_and_a_step_up_takes_back_a_draining_engine(scaled):
    scaler, gateway, sup, ready, said = scaled
    gateway.desired.update(prefill=4, decode=9)
    ready.update({"decode.1": True, "decode.2": True})
    for _ in range(8):
        scaler.round()
    assert gateway.pairs.pool(0) == ["p:0"] and gateway.pairs.pool(1) == ["d:0", "d:1", "d:2"]
    assert sorted(sup.children) == ["decode.1", "decode.2"]
    (pair,) = gateway.pairs.pairs_with(1, "d:2")
    gateway.pairs.loads.started(pair, "fpga")
    gateway.desired["decode"] = 2
    scaler.round()
    assert gateway.pairs.draining == {(1, "d:2")}
    gateway.desired["decode"] = 3
    scaler.round()
    assert not gateway.pairs.draining and sorted(sup.children) == ["decode.1", "decode.2"]
    assert any("decode.2 at d:2 serves again" in m for m in said), said
