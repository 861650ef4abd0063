"""Many pairs behind one gateway: the pair choice on fake loads, the dispatcher over two fake pairs
(route, retry and migration to another pair first), the pairs setting, and discovery through DNS.

Fakes stand in for the engines as in test_dispatch.py (the live path with real processes is
tests/stack/test_up_pairs.py); the router, the load book and the resolver (loopback) are real.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import REGISTRY

from services.gateway.dispatch.dispatcher import Dispatcher
from services.gateway.fleet.pair_discovery import DnsPairs, resolve_addresses
from services.gateway.fleet.pair_load import PairLoads
from services.gateway.fleet.pairs import Pairs, parse_pairs
from services.gateway.routing.engine_watch import report_load
from services.gateway.routing.router import Router
from services.gateway.settings import GatewaySettings
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from tests.gateway.test_dispatch import FakeEngines, request, rpc_error, token


# ---- the pair choice on fake loads --------------------------------------------------------
def test_the_least_loaded_pair_for_the_mode_wins():
    loads = PairLoads()
    loads.report(0, "fpga", running=6, waiting=2, max_num_seqs=8, kv_usage=0.1)  # full
    loads.report(1, "fpga", running=2, waiting=0, max_num_seqs=8, kv_usage=0.9)
    loads.report(0, "gpu", running=0, waiting=0, max_num_seqs=8, kv_usage=0.0)
    loads.report(1, "gpu", running=4, waiting=0, max_num_seqs=8, kv_usage=0.0)
    assert loads.choose("fpga", [0, 1]) == 1
    assert loads.choose("gpu", [0, 1]) == 0
    assert loads.choose("hybrid", [0, 1]) == 1  # the busier engine of the mode decides: 8/8 vs 4/8
    assert loads.choose("fpga", [0]) == 0  # only the pairs that can serve the mode count


def test_load_is_a_share_of_the_batch_so_a_bigger_pair_takes_more():
    loads = PairLoads()
    loads.report(0, "gpu", running=4, waiting=0, max_num_seqs=16, kv_usage=0.0)
    loads.report(1, "gpu", running=3, waiting=0, max_num_seqs=4, kv_usage=0.0)
    assert loads.choose("gpu", [0, 1]) == 0


def test_calls_sent_since_the_last_report_count_so_a_burst_spreads():
    loads = PairLoads()
    for p in (0, 1):
        loads.report(p, "gpu", running=0, waiting=0, max_num_seqs=4, kv_usage=0.0)
    chosen = []
    for _ in range(6):
        p = loads.choose("gpu", [0, 1])
        loads.started(p, "gpu")
        chosen.append(p)
    assert sorted(chosen) == [0, 0, 0, 1, 1, 1]
    # a report that already counts those calls does not count them twice
    loads.report(0, "gpu", running=3, waiting=0, max_num_seqs=4, kv_usage=0.0)
    assert loads.load(0, "gpu") == (0.75, 0.0)
    loads.finished(0, "gpu")
    assert loads.load(0, "gpu") == (0.75, 0.0)  # the engine says 3 until its next report


def test_a_call_opened_while_the_info_was_on_the_wire_still_counts():
    # the race CI hit: pair 1's Info left before a long stream was admitted there, its reply was
    # recorded after the gateway had opened the call, so the report looked as if it counted it
    loads = PairLoads()
    loads.report(0, "fpga", running=0, waiting=0, max_num_seqs=2, kv_usage=0.3)
    loads.started(1, "fpga")
    loads.report(1, "fpga", running=0, waiting=0, max_num_seqs=2, kv_usage=0.0)
    assert loads.load(1, "fpga") == (0.5, 0.0) and loads.queued(1, "fpga") == 1
    assert loads.choose("fpga", [0, 1]) == 0


def test_kv_usage_breaks_a_tie():
    loads = PairLoads()
    loads.report(0, "fpga", running=1, waiting=0, max_num_seqs=4, kv_usage=0.7)
    loads.report(1, "fpga", running=1, waiting=0, max_num_seqs=4, kv_usage=0.2)
    assert loads.choose("fpga", [0, 1]) == 1


def test_no_pair_for_the_mode_is_a_lookup_error():
    with pytest.raises(LookupError):
        PairLoads().choose("gpu", [])


# ---- the dispatcher over two pairs ------------------------------------------------------------
def two_pairs(**kw) -> tuple[Pairs, FakeEngines, FakeEngines]:
    a, b = FakeEngines(**kw.get("a", {})), FakeEngines(**kw.get("b", {}))
    return Pairs([a, b]), a, b


def calls_counted(pair: int, mode: str) -> float:
    return REGISTRY.get_sample_value("hybridserve_pair_calls_total", {"pair": str(pair), "mode": mode}) or 0.0


def test_a_request_goes_to_the_less_loaded_pair_and_is_counted_there():
    pairs, a, b = two_pairs()
    pairs.loads.report(0, "fpga", running=3, waiting=1, max_num_seqs=4, kv_usage=0.5)
    pairs.loads.report(1, "fpga", running=1, waiting=0, max_num_seqs=4, kv_usage=0.5)
    before = calls_counted(1, "hybrid")
    stream = asyncio.run(Dispatcher(pairs, Router()).open(request()))
    assert (stream.decision.mode, stream.decision.pair) == ("hybrid", 1)
    assert not a.calls and len(b.calls) == 1 and calls_counted(1, "hybrid") == before + 1
    assert pairs.loads.ours(1, "fpga") == 1  # open until cancelled
    stream.cancel()
    stream.cancel()
    assert pairs.loads.ours(1, "fpga") == 0


def test_a_pair_with_an_engine_down_serves_only_the_modes_it_can():
    pairs, a, b = two_pairs(a={"up": ("gpu",)})
    d = Dispatcher(pairs, Router())
    stream = asyncio.run(d.open(request("fpga")))
    assert stream.decision.pair == 1
    assert pairs.serving("gpu") == [0, 1] and pairs.serving("hybrid") == [1]


def test_a_forced_mode_no_pair_serves_is_503():
    pairs, a, b = two_pairs(a={"up": ("gpu",)}, b={"up": ("gpu",)})
    from services.gateway.protocol.errors import APIError
    with pytest.raises(APIError) as err:
        asyncio.run(Dispatcher(pairs, Router()).open(request("hybrid")))
    assert err.value.status == 503 and "decode_fpga" in err.value.message


def test_a_call_refused_by_a_dead_pair_is_retried_on_the_other_pair_in_the_same_mode():
    pairs, a, b = two_pairs(a={"scripts": {"fpga": [[rpc_error(grpc.StatusCode.UNAVAILABLE)]]}})
    a.alive["fpga"] = False  # health has not noticed yet
    stream = asyncio.run(Dispatcher(pairs, Router()).open(request()))
    assert (stream.decision.mode, stream.decision.pair) == ("hybrid", 1)
    assert [c[0] for c in a.calls] == ["fpga"] and len(b.calls) == 1 and not a.up["fpga"]


async def _read_all(pairs: Pairs, req):
    stream = await Dispatcher(pairs, Router()).open(req)
    ids = list(stream.first.token_ids)
    msg = stream.first
    while not msg.finish_reason:
        msg = await stream.read()
        ids += list(msg.token_ids)
    stream.cancel()
    return stream, ids


def test_a_lost_pair_migrates_its_request_to_the_same_mode_on_the_other_pair():
    pairs, a, b = two_pairs(a={"scripts": {"fpga": [[token(11), token(12), rpc_error(grpc.StatusCode.UNAVAILABLE)]]}},
                            b={"scripts": {"fpga": [[token(13), token(14, "length")]]}})
    pairs.loads.report(1, "fpga", running=4, waiting=0, max_num_seqs=4, kv_usage=0.0)  # pair 0 first
    a.alive["fpga"] = False
    stream, ids = asyncio.run(_read_all(pairs, request(prompt_len=3, max_tokens=4)))
    assert ids == [11, 12, 13, 14]  # none twice, none missing
    [(engine, rest, _, _)] = b.calls
    assert engine == "fpga" and rest.mode == pb.MODE_HYBRID and list(rest.prompt_token_ids) == [1, 2, 3, 11, 12]
    assert (stream.decision.mode, stream.decision.pair, stream.decision.reason) == ("hybrid", 1, "migration")
    assert [(m.from_pair, m.to_pair, m.after_tokens) for m in stream.migrations] == [(0, 1, 2)]
    assert pairs.loads.ours(0, "fpga") == 0 and pairs.loads.ours(1, "fpga") == 0


def test_with_no_other_pair_for_the_mode_a_migration_changes_mode():
    pairs, a, b = two_pairs(a={"scripts": {"fpga": [[token(11), rpc_error(grpc.StatusCode.UNAVAILABLE)]]}},
                            b={"up": ("gpu",), "scripts": {"gpu": [[token(12, "length")]]}})
    a.alive["fpga"] = False
    stream, ids = asyncio.run(_read_all(pairs, request(max_tokens=2)))
    assert ids == [11, 12] and stream.decision.mode == "gpu"


# ---- the watch's load report ----------------------------------------------------------------
def test_the_watch_reports_each_pair_and_the_sum_to_the_router():
    pairs, a, b = two_pairs(a={"up": ("gpu",)})
    for clients, running in ((a, 2), (b, 3)):
        clients.info = {e: pb.InfoResponse(num_requests_running=running, num_requests_waiting=1, max_num_seqs=4,
                                           kv_cache_usage_ratio=0.25) for e in ("gpu", "fpga")}
    router = Router()
    report_load(pairs, router)
    assert pairs.loads.load(1, "fpga") == (1.0, 0.25) and pairs.loads.load(0, "gpu") == (0.75, 0.25)
    assert pairs.loads.load(0, "fpga") == (0.0, 0.0)  # down: not reported
    snap = router.snapshot()["engines"]
    assert (snap["gpu"]["running"], snap["gpu"]["waiting"], snap["gpu"]["concurrency"]) == (5, 2, 8)
    assert (snap["fpga"]["running"], snap["fpga"]["concurrency"]) == (3, 4)


# ---- settings and discovery ----------------------------------------------------------------------
def test_the_pairs_setting_lists_pairs_and_the_two_addresses_stay_one_pair():
    assert parse_pairs("p1:1,d1:2; p2:3,d2:4;") == [("p1:1", "d1:2"), ("p2:3", "d2:4")]
    s = GatewaySettings(pairs="p1:1,d1:2;p2:3,d2:4")
    assert s.pair_addresses() == [("p1:1", "d1:2"), ("p2:3", "d2:4")]
    one = GatewaySettings(prefill_address="h:5", decode_address="h:6")
    assert one.pair_addresses() == [("h:5", "h:6")]


@pytest.mark.parametrize("bad", ["p1:1", "p1:1,d1", "p1:1,d1:2,x:3", ";"])
def test_a_malformed_pairs_setting_is_refused(bad):
    with pytest.raises(ValueError):
        GatewaySettings(pairs=bad)


def test_pools_make_every_combination_a_pair_and_name_the_prefill_engine_of_hybrid_calls():
    s = GatewaySettings(prefill_pool="p:1,p:2", decode_pool="d:3")
    assert s.pools and s.pair_addresses() == [("p:1", "d:3"), ("p:2", "d:3")]
    addresses = dict(enumerate(s.pair_addresses()))
    pools = Pairs({i: FakeEngines() for i in addresses}, addresses, pools=True)
    assert [pools.prefill_address(i, "hybrid") for i in addresses] == ["p:1", "p:2"]
    assert pools.prefill_address(1, "gpu") == pools.prefill_address(1, "fpga") == ""  # one engine: nothing to name
    pairs = Pairs({i: FakeEngines() for i in addresses}, addresses)
    assert pairs.prefill_address(1, "hybrid") == ""  # a pair's decode engine pulls from its own


@pytest.mark.parametrize("bad", [{"prefill_pool": "p:1"}, {"prefill_pool": "p:1", "decode_pool": "d"},
                                 {"prefill_pool": "p:1", "decode_pool": "d:2", "pairs": "p:1,d:2"}])
def test_a_malformed_or_half_pool_setting_is_refused(bad):
    with pytest.raises(ValueError):
        GatewaySettings(**bad)


class Connected(FakeEngines):
    def __init__(self, address):
        super().__init__()
        self.address, self.closed = address, False

    async def close(self):
        self.closed = True


def test_dns_discovery_resolves_loopback_and_follows_pods_coming_and_going():
    async def run():
        pairs = Pairs({})
        assert "127.0.0.1" in await resolve_addresses("localhost")
        answers = {"now": None}

        async def resolver(name):
            return await resolve_addresses(name) if answers["now"] is None else answers["now"]
        dns = DnsPairs(pairs, "localhost", 50061, 50062, Connected, refresh_s=0.0, resolver=resolver)
        await dns.refresh()
        assert ("127.0.0.1:50061", "127.0.0.1:50062") in pairs.addresses.values()
        answers["now"] = ["10.0.0.1", "10.0.0.2"]
        await dns.refresh()
        assert sorted(pairs.addresses.values()) == [("10.0.0.1:50061", "10.0.0.1:50062"),
                                                    ("10.0.0.2:50061", "10.0.0.2:50062")]
        gone = pairs.members[0]
        answers["now"] = ["10.0.0.2", "10.0.0.3"]  # pod 1 left, pod 3 came: it takes the free index
        await dns.refresh()
        assert gone.closed and pairs.addresses == {1: ("10.0.0.2:50061", "10.0.0.2:50062"),
                                                   0: ("10.0.0.3:50061", "10.0.0.3:50062")}

        async def failing(name):
            raise OSError("no answer")
        dns.resolver = failing
        await dns.refresh()
        assert len(pairs) == 2  # a failed lookup keeps the pairs
    asyncio.run(run())


def test_a_forced_mode_refused_by_a_dead_pair_is_retried_on_another_pair_never_in_another_mode():
    pairs, a, b = two_pairs(a={"scripts": {"gpu": [[rpc_error(grpc.StatusCode.UNAVAILABLE)]]}})
    a.alive["gpu"] = False
    stream = asyncio.run(Dispatcher(pairs, Router()).open(request("gpu")))
    assert (stream.decision.mode, stream.decision.pair) == ("gpu", 1)
    pairs, a, b = two_pairs(a={"scripts": {"gpu": [[rpc_error(grpc.StatusCode.UNAVAILABLE)]]}},
                            b={"up": ("fpga",)})
    a.alive["gpu"] = False
    from services.gateway.protocol.errors import APIError
    with pytest.raises(APIError) as err:
        asyncio.run(Dispatcher(pairs, Router()).open(request("gpu")))
    assert err.value.status == 503 and not b.calls


class Yielding:
    """A call whose first message takes a turn of the event loop, as a real engine's does."""

    def __init__(self, call):
        self.call = call

    async def read(self):
        await asyncio.sleep(0)
        return await self.call.read()

    def cancel(self):
        self.call.cancel()


def test_calls_waiting_for_their_first_token_count_so_a_burst_spreads_over_the_pairs():
    pairs, a, b = two_pairs()
    for fake in (a, b):
        fake.generate = (lambda f: lambda *args, **kw: Yielding(FakeEngines.generate(f, *args, **kw)))(fake)

    async def burst():
        d = Dispatcher(pairs, Router())
        return await asyncio.gather(*(d.open(request("gpu")) for _ in range(4)))
    streams = asyncio.run(burst())
    assert sorted(s.decision.pair for s in streams) == [0, 0, 1, 1]
    for s in streams:
        s.cancel()
    assert pairs.loads.ours(0, "gpu") == pairs.loads.ours(1, "gpu") == 0


def test_a_failed_call_leaves_no_count_on_its_pair():
    pairs, a, b = two_pairs(a={"scripts": {"fpga": [[rpc_error(grpc.StatusCode.UNAVAILABLE)]]}},
                            b={"scripts": {"fpga": [[rpc_error(grpc.StatusCode.UNAVAILABLE)]]}})
    from services.gateway.protocol.errors import APIError
    with pytest.raises(APIError):
        asyncio.run(Dispatcher(pairs, Router()).open(request("fpga")))
    assert pairs.loads.ours(0, "fpga") == pairs.loads.ours(1, "fpga") == 0
