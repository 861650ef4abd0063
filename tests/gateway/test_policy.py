"""The mode policy seam (routing/policy.py): the dispatcher routes with any ModePolicy, not only the router,
and a policy that implements `choose` alone is a whole policy."""
import asyncio

import grpc
import pytest

from services.gateway.dispatch.dispatcher import Dispatcher
from services.gateway.routing.policy import Decision, ModePolicy
from services.gateway.routing.router import Router
from tests.gateway.test_dispatch import FakeEngines, request, rpc_error, token


class CheapestFirst(ModePolicy):
    """A policy of a few lines: the first of `order` that is available; it learns nothing."""

    def __init__(self, order: list[str]):
        self.order, self.asked = order, []

    def choose(self, n_in, n_out, forced=None, available=()):
        self.asked.append((n_in, n_out, forced, tuple(available)))
        if forced is not None:
            return Decision(forced, "forced", {})
        mode = next((m for m in self.order if m in available), None)
        if mode is None:
            raise LookupError("no mode available")
        return Decision(mode, "auto", {})


def test_the_dispatcher_routes_with_any_policy_and_tells_it_what_is_up():
    policy = CheapestFirst(["fpga", "gpu", "hybrid"])
    engines = FakeEngines(up=("gpu",))  # decode_fpga down: only gpu mode can serve
    stream = asyncio.run(Dispatcher(engines, policy).open(request(prompt_len=5, max_tokens=4)))
    assert (stream.decision.mode, stream.decision.reason) == ("gpu", "fallback")
    assert policy.asked == [(5, 4, None, ("gpu",))]
    assert [engine for engine, *_ in engines.calls] == ["gpu"]


def test_a_retry_asks_the_policy_again_among_the_modes_left():
    policy = CheapestFirst(["hybrid", "gpu", "fpga"])
    engines = FakeEngines(scripts={"fpga": [[rpc_error(grpc.StatusCode.UNAVAILABLE)]], "gpu": [[token(3, "length")]]})
    engines.alive["fpga"] = False  # the health check after the failure finds decode_fpga gone
    stream = asyncio.run(Dispatcher(engines, policy).open(request()))
    assert stream.decision.mode == "gpu"
    assert [a[3] for a in policy.asked] == [("gpu", "fpga", "hybrid"), ("gpu",)]


def test_the_router_is_a_mode_policy_and_a_policy_must_choose():
    assert isinstance(Router(), ModePolicy)
    with pytest.raises(TypeError):
        ModePolicy()  # choose is abstract
    quiet = CheapestFirst(["gpu"])  # the learning calls default to doing nothing
    quiet.observe([{"stage": "prefill", "device": "gpu", "n_in": 4, "seconds": 0.1}])
    quiet.started("gpu", 0.1)
    quiet.finished("gpu", 1.0, 0.1)
    assert quiet.lifetime_company({"gpu": 1}) is None
