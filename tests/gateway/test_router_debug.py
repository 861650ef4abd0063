"""`GET /debug/router` serves the router's live snapshot: it changes as requests are observed."""
from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.gateway.api.router_debug import debug_routes
from services.gateway.routing.router import Router
from services.gateway.routing.samples import samples_from_timings
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


def test_debug_kv_index_shows_each_engines_blocks_and_forgets_an_engine_found_down():
    from types import SimpleNamespace

    from services.gateway.fleet.kv_index import EngineBlocks, prompt_hashes
    from services.rpc.hybridserve.v1 import engine_pb2 as pb

    blocks = {"gpu": EngineBlocks(), "fpga": EngineBlocks()}
    stored = prompt_hashes(list(range(48)), 16)
    blocks["fpga"].apply(pb.InfoResponse(block_size=16, kv_events=pb.KVEvents(epoch="e1", seq=3, snapshot=True,
                                                                               stored=stored)))
    pairs = SimpleNamespace(members={0: SimpleNamespace(up={"gpu": True, "fpga": True}, blocks=blocks)})
    app = FastAPI()
    app.include_router(debug_routes(lambda: Router(synthetic_samples()), lambda: pairs))
    client = TestClient(app)
    body = client.get("/debug/kv_index").json()
    assert body["pairs"]["0"]["decode_fpga"] == {"up": True, "epoch": "e1", "seq": 3, "block_size": 16, "blocks": 3}
    assert body["pairs"]["0"]["prefill_gpu"]["blocks"] == 0
    pairs.members[0].up["fpga"] = False  # as EngineClients.check does when the engine stops answering
    blocks["fpga"].clear()
    assert client.get("/debug/kv_index").json()["pairs"]["0"]["decode_fpga"] == {
        "up": False, "epoch": "", "seq": 0, "block_size": 16, "blocks": 0}
