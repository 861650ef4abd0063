"""Readiness (/health) and the calibration check's yielding, in process: the body and status each state
gives, the latch that keeps a ready gateway ready through a re-check, and a check that runs only between
requests. The live cold start is tests/gateway/test_readiness_live.py."""
from __future__ import annotations

import asyncio

from services.gateway.api.readiness import Readiness
from services.gateway.fleet.pair_load import PairLoads
from services.gateway.routing.calibration_check import _between_requests

BOTH_UP = {0: {"gpu": True, "fpga": True}}


def test_not_ready_until_calibrated_once_and_the_body_says_what_it_waits_on():
    r = Readiness()
    body, status = r.health({0: {"gpu": True, "fpga": False}}, calibrated=False, draining=False, one_pair=True)
    assert status == 503 and body.status == "starting" and not body.ready
    assert body.waiting_for == ["decode_fpga", "calibration"] and body.engines == {"prefill_gpu": "up",
                                                                                 "decode_fpga": "down"}
    body, status = r.health(BOTH_UP, calibrated=False, draining=False, one_pair=True)
    assert status == 503 and body.waiting_for == ["calibration"]  # engines answer: the old code said 200 here
    body, status = r.health(BOTH_UP, calibrated=True, draining=False, one_pair=True)
    assert status == 200 and body.ready and body.status == "ok" and body.waiting_for == []


def test_once_ready_a_recheck_keeps_it_ready_but_no_serving_pair_or_a_drain_does_not():
    r = Readiness()
    r.health(BOTH_UP, calibrated=True, draining=False, one_pair=True)
    body, status = r.health(BOTH_UP, calibrated=False, draining=False, one_pair=True)  # an engine came back
    assert status == 200 and body.ready and not body.calibrated
    two = {0: {"gpu": True, "fpga": False}, 1: {"gpu": True, "fpga": True}}
    body, status = r.health(two, calibrated=True, draining=False, one_pair=False)
    assert status == 200 and body.status == "degraded" and body.engines["decode_fpga@0"] == "down"
    body, status = r.health({0: {"gpu": False, "fpga": True}}, calibrated=True, draining=False, one_pair=True)
    assert status == 503 and body.waiting_for == ["prefill_gpu"]
    body, status = r.health(BOTH_UP, calibrated=True, draining=True, one_pair=True)
    assert status == 503 and body.status == "draining" and body.waiting_for == ["drain"]


class _Pairs:
    """What _between_requests reads of the gateway's pairs: their load book (a real one)."""

    def __init__(self):
        self.loads = PairLoads()


def test_a_check_waits_for_open_calls_and_is_cancelled_when_one_opens():
    async def scenario():
        pairs, events = _Pairs(), []

        async def check(seconds: float):
            events.append("check started")
            try:
                await asyncio.sleep(seconds)
            except asyncio.CancelledError:
                events.append("check cancelled")
                raise
            return "timings"

        pairs.loads.started(0, "gpu")  # a request is open: the check must not start
        waiting = asyncio.ensure_future(_between_requests(pairs, lambda: check(0.01)))
        await asyncio.sleep(0.3)
        assert events == [] and not waiting.done()
        pairs.loads.finished(0, "gpu")
        assert await asyncio.wait_for(waiting, 10) == "timings" and events == ["check started"]

        events.clear()
        running = asyncio.ensure_future(_between_requests(pairs, lambda: check(60)))
        while not events:
            await asyncio.sleep(0.01)
        pairs.loads.started(0, "hybrid")  # a request arrives mid-check: the check gives the engines back
        assert await asyncio.wait_for(running, 10) is None
        assert events == ["check started", "check cancelled"]

    asyncio.run(scenario())
