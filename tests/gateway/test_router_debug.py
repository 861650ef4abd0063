"""`GET /debug/router` serves the router's live snapshot: it changes as requests are observed."""
from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.gateway.router import Router, samples_from_timings
from services.gateway.router_debug import debug_routes
from tests.gateway.test_router import synthetic_samples


def test_debug_router_shows_coefficients_and_learns():
    router = Router(synthetic_samples())
    app = FastAPI()
    app.include_router(debug_routes(lambda: router))
    client = TestClient(app)
    first = client.get("/debug/router")
    assert first.status_code == 200
    body = first.json()
    assert body["base"]["decode/fpga"]["d"] > 0 and body["corrections"] == {}
    router.observe(samples_from_timings("fpga", 64, {"prefill_s": 1.0, "decode_tokens": 10, "decode_s": 2.0}))
    after = client.get("/debug/router").json()
    assert set(after["corrections"]) == {"prefill/fpga", "decode/fpga"}
    assert after["corrections"]["decode/fpga"]["online_samples"] == 1
