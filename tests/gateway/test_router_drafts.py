"""The router and speculative decoding (routing/draft_gain.py): a few requests that drafts sped up do not make
an engine look faster for every request, and a load that mostly gains teaches its typical gain. Scripted
truth (test_router's), no engines."""
from __future__ import annotations

import pytest

from services.gateway.routing.draft_gain import DraftGain, plain_seconds
from services.gateway.routing.router import Router
from services.gateway.routing.samples import samples_from_timings
from services.modes import MODES
from tests.gateway.test_router import synthetic_samples
from tests.gateway.test_router_learning import LOAD, timings_of

FPGA_DECODE = MODES["fpga"].decode_engine


def finish(router: Router, n_in: int, n_out: int, speedup: float = 1.0) -> None:
    """A finished fpga request whose accepted drafts made its decode `speedup` x faster."""
    t = timings_of("fpga", n_in, n_out)
    if speedup > 1:
        t["accepted_draft_tokens"] = int(t["decode_tokens"] * (1 - 1 / speedup))
        t["decode_s"] /= speedup
    router.observe(samples_from_timings("fpga", n_in, t, {e: 0 for e in MODES["fpga"].engines}))


def decode_estimate(router: Router) -> float:
    return router.stage_seconds("decode", FPGA_DECODE, 200, 128)


def test_one_request_sped_up_by_drafts_leaves_the_engines_estimate_alone():
    """The correction is the smallest recent ratio: taken as it came, one copy-heavy request 3x faster made
    every decode on the engine look 3x cheaper (auto then sent it all the work)."""
    router = Router(synthetic_samples())
    for n_in, n_out in LOAD[:6]:
        finish(router, n_in, n_out)
    before = decode_estimate(router)
    finish(router, 120, 128, speedup=3.0)
    assert decode_estimate(router) == pytest.approx(before, rel=0.05)


def test_a_load_that_mostly_gains_teaches_its_typical_gain_and_a_plain_one_takes_it_back():
    router = Router(synthetic_samples())
    for n_in, n_out in LOAD[:4]:
        finish(router, n_in, n_out)
    plain = decode_estimate(router)
    for n_in, n_out in LOAD * 2:
        finish(router, n_in, n_out, speedup=2.0)
    assert decode_estimate(router) == pytest.approx(plain / 2, rel=0.15)
    assert router.snapshot()["engines"][FPGA_DECODE]["draft_gain"] == pytest.approx(0.5, rel=0.15)
    for n_in, n_out in LOAD * 2:
        finish(router, n_in, n_out)
    assert decode_estimate(router) == pytest.approx(plain, rel=0.05)


def test_a_drafted_samples_time_is_scaled_to_its_steps_and_the_gain_is_a_bounded_median():
    assert plain_seconds({"seconds": 1.0, "n_out": 100, "accepted": 75}) == pytest.approx(4.0)
    assert plain_seconds({"seconds": 1.0, "n_out": 100}) == 1.0
    gain = DraftGain(window=5)
    gain.add(1.0, 2.0), gain.add(1.0, 2.0)
    assert gain.factor() == 1.0  # too few to say
    gain.add(3.0, 1.0)
    assert gain.factor() == 0.5  # the median of 0.5, 0.5, 3: one slow decode moves it not
    for _ in range(5):
        gain.add(1.0, 100.0)
    assert gain.factor() == 0.1  # at most 10x
