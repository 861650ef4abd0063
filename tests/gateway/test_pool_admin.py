"""Pools changed while the gateway runs (pairs.py's join/drain/leave, pool_admin.py's routes): an engine
joins as a pair with every engine of the other pool, a draining one takes no new call but keeps its open
ones and serves again when taken back, one with calls open is not removed unless forced, and the routes
answer OpenAI error JSON (403 off loopback, 404 for an engine not in the pool, 409s).

Fakes stand in for the engines as in test_pairs.py (the live path: tests/stack/test_up_pools.py);
the routes are the gateway app's own, without its lifespan (no tokenizer, no engine watch).
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from services.gateway.api.app import create_app
from services.gateway.dispatch.dispatcher import Dispatcher
from services.gateway.fleet.pairs import Pairs
from services.gateway.routing.router import Router
from services.gateway.settings import GatewaySettings
from tests.gateway.test_dispatch import FakeEngines, request


def pools() -> Pairs:
    addresses = dict(enumerate(GatewaySettings(prefill_pool="p:1", decode_pool="d:1").pair_addresses()))
    return Pairs({i: FakeEngines() for i in addresses}, addresses, pools=True)


def test_an_engine_joins_drains_with_its_calls_open_and_leaves():
    pairs = pools()
    assert pairs.join_pool(0, "p:2", lambda a: FakeEngines()) == [1]  # (p:2, d:1)
    assert pairs.join_pool(1, "d:2", lambda a: FakeEngines()) == [2, 3]  # (p:1, d:2), (p:2, d:2)
    assert pairs.pool(0) == ["p:1", "p:2"] and pairs.pool(1) == ["d:1", "d:2"]
    assert pairs.addresses[3] == ("p:2", "d:2") and pairs.prefill_address(3, "hybrid") == "p:2"
    pairs.loads.started(2, "gpu")  # a gpu call on (p:1, d:2) runs through that pair's channel
    assert pairs.calls_on(1, "d:2") == 1 and pairs.calls_on(1, "d:1") == 0
    assert pairs.drain_pool_member(1, "d:2") == [2, 3]
    assert pairs.serving("fpga") == [0, 1] and pairs.serving("gpu") == [0, 1]
    dispatcher = Dispatcher(pairs, Router())
    for _ in range(4):  # nothing new goes to a draining engine's pairs
        assert asyncio.run(dispatcher.open(request(mode="fpga"))).decision.pair in (0, 1)
    assert pairs.join_pool(1, "d:2", lambda a: FakeEngines()) == [2, 3] and 2 in pairs.serving("fpga")
    pairs.drain_pool_member(1, "d:2")
    pairs.loads.finished(2, "gpu")
    assert pairs.calls_on(1, "d:2") == 0
    assert len(pairs.leave_pool(1, "d:2")) == 2 and pairs.pool(1) == ["d:1"] and not pairs.draining
    assert pairs.join_pool(1, "d:3", lambda a: FakeEngines()) == [2, 3]  # the lowest free labels again


@pytest.fixture
def admin():
    app = create_app(GatewaySettings(prefill_pool="p:1", decode_pool="d:1", pool_admin=True))
    app.state.hs = SimpleNamespace(pairs=pools(), connect=lambda address: FakeEngines())
    return app


def test_the_routes_change_the_pools_from_loopback(admin):
    client = TestClient(admin, client=("127.0.0.1", 40000))
    assert client.post("/admin/pools/decode/add", json={"address": "d:2"}).json() == {"pairs": [1]}
    listed = client.get("/admin/pools").json()
    assert [m["address"] for m in listed["decode"]] == ["d:1", "d:2"] and listed["prefill"][0]["pairs"] == [0, 1]
    admin.state.hs.pairs.loads.started(1, "hybrid")
    assert client.post("/admin/pools/decode/drain", json={"address": "d:2"}).json() == {"pairs": [1], "calls_open": 1}
    refused = client.post("/admin/pools/decode/remove", json={"address": "d:2"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "calls_open"
    assert refused.json()["error"]["param"] == "address"
    assert client.post("/admin/pools/decode/remove", json={"address": "d:2", "force": True}).json() == {
        "removed_pairs": 1, "calls_open": 1}
    last = client.post("/admin/pools/decode/remove", json={"address": "d:1"})
    assert last.status_code == 409 and last.json()["error"]["code"] == "last_engine"
    missing = client.post("/admin/pools/prefill/drain", json={"address": "p:9"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_in_pool"
    bad = client.post("/admin/pools/cache/add", json={"address": "d:2"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "pool"
    bad = client.post("/admin/pools/decode/add", json={"address": "nowhere"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "address"


def test_the_routes_refuse_a_client_off_loopback_and_are_absent_unless_asked_for(admin):
    refused = TestClient(admin, client=("192.0.2.7", 40000)).post("/admin/pools/decode/add", json={"address": "d:2"})
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    assert admin.state.hs.pairs.pool(1) == ["d:1"]
    plain = create_app(GatewaySettings(prefill_pool="p:1", decode_pool="d:1"))
    assert TestClient(plain, client=("127.0.0.1", 40000)).get("/admin/pools").status_code == 404


def test_the_document_declares_the_routes_errors_in_the_error_shape(admin):
    doc = TestClient(admin, client=("127.0.0.1", 40000)).get("/openapi.json").json()
    responses = doc["paths"]["/admin/pools/{pool}/remove"]["post"]["responses"]
    for status in ("400", "401", "403", "404", "409"):
        assert responses[status]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/ErrorBody"
    assert "422" not in responses
