"""The dispatcher's decisions (route, retry, fallback, errors) against a fake engine client.

A fake stands in for the engines here because the real path (real gRPC to real engines) runs in
test_api*.py and test_engine_failure.py; these pin down each decision on its own, fast.
The router is the real one.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from services.gateway.dispatch.dispatcher import MAX_ATTEMPTS, NEVER_MIGRATE, Dispatcher
from services.gateway.dispatch.request import RoutedRequest
from services.gateway.protocol.errors import APIError
from services.gateway.routing.router import Router
from tests.gateway.test_router import synthetic_samples
from services.gateway.protocol.schemas import CompletionRequest
from services.modes import MODES
from services.rpc.hybridserve.v1 import engine_pb2 as pb

LEAK = "arena /hybridserve-kv-1234 offset 8192: Traceback (most recent call last)"


def rpc_error(code: grpc.StatusCode, details: str = LEAK) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def token(t: int, finish: str = "") -> pb.GenerateResponse:
    return pb.GenerateResponse(token_ids=[t], finish_reason=finish)


class FakeCall:
    """A Generate call that plays back a script: messages, then EOF; an exception in it is raised."""

    def __init__(self, script):
        self.script, self.cancelled = list(script), False

    async def read(self):
        if not self.script:
            return grpc.aio.EOF
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class FakeEngines:
    """What the dispatcher uses of EngineClients. `alive`: what a health check would find."""

    def __init__(self, up=("gpu", "fpga"), context=2048, scripts=None):
        self.up = {e: e in up for e in ("gpu", "fpga")}
        self.alive = dict(self.up)
        self.context = {"gpu": context, "fpga": context}
        self.scripts = {e: list(s) for e, s in (scripts or {}).items()}  # engine -> [script per call]
        self.calls: list[tuple[str, pb.GenerateRequest, float, FakeCall]] = []
        self.checked: list[str] = []

    def context_of(self, engine):
        return self.context[engine]

    async def check(self, engine):
        self.checked.append(engine)
        self.up[engine] = self.alive[engine]
        return self.up[engine]

    def generate(self, engine, request, timeout):
        call = FakeCall(self.scripts[engine].pop(0) if self.scripts.get(engine) else [token(1, "length")])
        self.calls.append((engine, request, timeout, call))
        return call


def request(mode="auto", prompt_len=5, max_tokens=4, **extra) -> RoutedRequest:
    body = CompletionRequest(model="m", prompt=list(range(1, prompt_len + 1)), max_tokens=max_tokens, mode=mode,
                             **extra)
    return RoutedRequest.of(body, "cmpl-test", list(body.prompt), max_tokens, max_timeout_s=600.0)


def open_stream(engines: FakeEngines, req: RoutedRequest):
    return asyncio.run(Dispatcher(engines, Router()).open(req))


def open_error(engines: FakeEngines, req: RoutedRequest) -> APIError:
    with pytest.raises(APIError) as err:
        open_stream(engines, req)
    return err.value


# ---- routing ------------------------------------------------------------------------------
def test_every_mode_up_is_auto_and_the_request_goes_to_the_engine_serving_the_mode():
    engines = FakeEngines()
    stream = open_stream(engines, request(temperature=0.5, seed=7))
    # an uncalibrated router picks hybrid, which decode_fpga serves
    assert (stream.decision.mode, stream.decision.reason) == ("hybrid", "auto")
    [(engine, sent, timeout, _)] = engines.calls
    assert engine == "fpga" and sent.mode == pb.MODE_HYBRID and sent.request_id == "cmpl-test"
    assert list(sent.prompt_token_ids) == [1, 2, 3, 4, 5] and timeout == 600.0
    assert (sent.sampling.max_tokens, sent.sampling.seed) == (4, 7)
    assert sent.sampling.temperature == pytest.approx(0.5)
    assert stream.first.token_ids == [1]


@pytest.mark.parametrize("mode,engine,proto", [(m.name, m.served_by, m.proto) for m in MODES.values()])
def test_a_forced_mode_is_sent_as_is(mode, engine, proto):
    engines = FakeEngines()
    stream = open_stream(engines, request(mode))
    assert (stream.decision.mode, stream.decision.reason) == (mode, "forced")
    assert [(e, r.mode) for e, r, _, _ in engines.calls] == [(engine, proto)]


def test_an_engine_down_is_a_fallback_to_the_modes_left():
    engines = FakeEngines(up=("gpu",))
    stream = open_stream(engines, request())
    assert (stream.decision.mode, stream.decision.reason) == ("gpu", "fallback")
    assert set(stream.decision.estimates) <= {"gpu"}


def test_a_window_too_small_for_one_mode_is_a_fallback_to_the_others():
    engines = FakeEngines()
    engines.context["fpga"] = 8  # fpga and hybrid both need decode_fpga's window
    stream = open_stream(engines, request(prompt_len=5, max_tokens=4))
    assert (stream.decision.mode, stream.decision.reason) == ("gpu", "fallback")


def test_a_forced_mode_whose_engine_is_down_is_503_naming_it():
    engines = FakeEngines(up=("gpu",))
    err = open_error(engines, request("hybrid"))
    assert (err.status, err.code, err.param) == (503, "engine_unavailable", "mode")
    assert "decode_fpga" in err.message and not engines.calls


def test_nothing_up_is_503_and_nothing_fitting_is_400():
    err = open_error(FakeEngines(up=()), request())
    assert (err.status, err.code) == (503, "engine_unavailable")
    err = open_error(FakeEngines(context=8), request(prompt_len=5, max_tokens=4))
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "max_tokens")
    assert "8 tokens" in err.message
    err = open_error(FakeEngines(context=8), request("gpu", prompt_len=5, max_tokens=4))
    assert (err.status, err.code) == (400, "context_length_exceeded")


def test_the_request_timeout_only_shortens():
    engines = FakeEngines()
    open_stream(engines, request(timeout=2.5))
    open_stream(engines, request(timeout=9999))
    assert [t for _, _, t, _ in engines.calls] == [2.5, 600.0]


class HeldCall(FakeCall):
    """A call whose first message waits for `release` (a prefill still running)."""

    def __init__(self, script, release: asyncio.Event):
        super().__init__(script)
        self.release = release

    async def read(self):
        await self.release.wait()
        return await super().read()


def test_requests_of_a_burst_see_each_other_before_their_first_tokens():
    """Three requests arrive together and wait for their first tokens: each is routed seeing the ones
    before it on the engines (company 0, 1, 2); counted only from their first tokens, all three found
    idle engines. Whatever way a call ends before its first message (a token, a failure, the client
    gone), the router's queue is back to what it was, and so is the prefill it counts ahead of the next."""
    engines = FakeEngines(scripts={"gpu": [[token(1, "length")], [rpc_error(grpc.StatusCode.INTERNAL)], []]})

    async def run():
        release = asyncio.Event()
        generate = engines.generate
        engines.generate = lambda e, r, timeout: HeldCall(generate(e, r, timeout).script, release)
        router, company, prefill = Router(synthetic_samples(), explore_share=0), [], []
        choose = router.choose
        router.choose = lambda *a, **kw: (d := choose(*a, **kw), company.append(d.company["gpu"]),
                                          prefill.append(d.prefill_s))[0]
        dispatcher = Dispatcher(engines, router)
        opened = [asyncio.ensure_future(dispatcher.open(request("gpu"))) for _ in range(3)]
        gone = asyncio.ensure_future(dispatcher.open(request("gpu")))
        await asyncio.sleep(0.05)
        busy, ahead = router.queued("gpu"), router.prefill_ahead_seconds("gpu")
        gone.cancel()
        release.set()
        results = await asyncio.gather(*opened, gone, return_exceptions=True)
        return company, busy, results, router.queued("gpu"), (prefill, ahead, router.prefill_ahead_seconds("gpu"))

    company, busy, results, after, (prefill, ahead, ahead_after) = asyncio.run(run())
    assert company == [0, 1, 2, 3] and busy == 4 and len(engines.calls) == 4
    # their prompts are ahead of the next request's first token until theirs come (router.py)
    assert prefill[0] > 0 and abs(ahead - sum(prefill)) < 1e-9 and ahead_after == 0
    stream, failed, ended, cancelled = results
    assert isinstance(failed, APIError) and isinstance(ended, APIError)
    assert isinstance(cancelled, asyncio.CancelledError)
    assert after == 0  # the stream's Run would count it from here; nothing else is left on the queue


# ---- retry and fallback -------------------------------------------------------------------
def test_unavailable_before_the_first_token_checks_health_and_routes_again():
    engines = FakeEngines(scripts={"fpga": [[rpc_error(grpc.StatusCode.UNAVAILABLE)]]})
    engines.alive["fpga"] = False  # the health check finds decode_fpga gone
    stream = open_stream(engines, request())
    assert [e for e, *_ in engines.calls] == ["fpga", "gpu"]
    assert sorted(engines.checked) == ["fpga", "gpu"]  # the engines of the mode that failed (hybrid)
    assert (stream.decision.mode, stream.decision.reason) == ("gpu", "fallback")
    assert engines.calls[0][1].request_id == engines.calls[1][1].request_id == "cmpl-test"


def test_retries_stop_after_max_attempts_with_503():
    down = [[rpc_error(grpc.StatusCode.UNAVAILABLE)]] * (MAX_ATTEMPTS + 1)
    engines = FakeEngines(scripts={"fpga": down, "gpu": down})
    err = open_error(engines, request())
    assert len(engines.calls) == MAX_ATTEMPTS
    assert (err.status, err.code) == (503, "engine_unavailable") and LEAK not in err.message


def test_a_forced_mode_is_not_retried():
    engines = FakeEngines(scripts={"gpu": [[rpc_error(grpc.StatusCode.UNAVAILABLE)]]})
    err = open_error(engines, request("gpu"))
    assert err.status == 503 and len(engines.calls) == 1 and not engines.checked


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT])
def test_other_failures_are_not_retried(code):
    engines = FakeEngines(scripts={"fpga": [[rpc_error(code)]]})
    open_error(engines, request())
    assert len(engines.calls) == 1 and not engines.checked


def test_a_call_that_ends_without_a_token_is_502():
    engines = FakeEngines(scripts={"fpga": [[]]})
    err = open_error(engines, request())
    assert (err.status, err.code) == (502, "engine_error") and len(engines.calls) == 1


# ---- after the first token ----------------------------------------------------------------
def test_after_the_first_token_messages_flow_and_failures_become_api_errors():
    script = [token(1), token(2), rpc_error(grpc.StatusCode.INTERNAL)]
    engines = FakeEngines(scripts={"fpga": [script]})

    async def run():
        stream = await Dispatcher(engines, Router()).open(request())
        second = await stream.read()
        with pytest.raises(APIError) as err:
            await stream.read()
        stream.cancel()
        return second, err.value

    second, err = asyncio.run(run())
    assert second.token_ids == [2] and len(engines.calls) == 1  # no retry once tokens flowed
    assert (err.status, err.message) == (500, "the engine failed while serving the request")
    assert engines.calls[0][3].cancelled


def test_an_early_end_of_the_stream_is_502():
    engines = FakeEngines(scripts={"fpga": [[token(1)]]})

    async def run():
        stream = await Dispatcher(engines, Router()).open(request())
        with pytest.raises(APIError) as err:
            await stream.read()
        return err.value

    err = asyncio.run(run())
    assert (err.status, err.code) == (502, "engine_error")


# ---- the status table ---------------------------------------------------------------------
FIXED = [
    (grpc.StatusCode.INTERNAL, 500, "server_error", "engine_error", "the engine failed while serving the request"),
    (grpc.StatusCode.UNKNOWN, 500, "server_error", "engine_error", "the engine failed while serving the request"),
    (grpc.StatusCode.FAILED_PRECONDITION, 502, "server_error", "engine_error",
     "the engines could not agree on the request's KV hand-off"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error", "engine_unavailable",
     "an engine this request needs is unavailable"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "engine_overloaded",
     "the engine is at capacity; retry later"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error", "timeout",
     "the request did not finish within its timeout"),
    (grpc.StatusCode.ABORTED, 502, "server_error", "engine_error",
     "the engine ended the request with an unexpected error"),
]


@pytest.mark.parametrize("code,status,kind,err_code,message", FIXED, ids=[f[0].name for f in FIXED])
def test_engine_failures_reach_the_client_as_fixed_messages_and_the_log_gets_the_details(
        code, status, kind, err_code, message, caplog):
    engines = FakeEngines(scripts={"gpu": [[rpc_error(code)]]})
    with caplog.at_level(logging.INFO, logger="services.gateway.protocol.errors"):
        err = open_error(engines, request("gpu"))
    assert (err.status, err.code, err.message) == (status, err_code, message)
    assert err.body().model_dump() == {"error": {"message": message, "type": kind, "param": None, "code": err_code}}
    assert any("cmpl-test" in r.getMessage() and LEAK in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("code,err_code", [(grpc.StatusCode.INVALID_ARGUMENT, "invalid_value"),
                                           (grpc.StatusCode.OUT_OF_RANGE, "context_length_exceeded")])
def test_a_400_keeps_the_engines_message_about_the_input(code, err_code):
    engines = FakeEngines(scripts={"gpu": [[rpc_error(code, "prompt of 3000 tokens exceeds 2048")]]})
    err = open_error(engines, request("gpu"))
    assert (err.status, err.code, err.message) == (400, err_code, "prompt of 3000 tokens exceeds 2048")


def test_a_retry_routes_around_the_mode_that_failed_even_when_health_says_up():
    """Just after a start both engines answer health checks while decode_fpga's own link to
    prefill_gpu is still in reconnect back-off: hybrid fails UNAVAILABLE, and the retry takes
    another mode instead of the same one again."""
    engines = FakeEngines(scripts={"fpga": [[rpc_error(grpc.StatusCode.UNAVAILABLE)]]})
    stream = open_stream(engines, request())
    assert [(e, r.mode) for e, r, _, _ in engines.calls][0] == ("fpga", pb.MODE_HYBRID)
    assert stream.decision.mode != "hybrid" and stream.decision.reason == "fallback"
    assert len(engines.calls) == 2


# ---- migration: the engine is lost after the first token ----------------------------------
def read_all(engines: FakeEngines, req: RoutedRequest):
    """Open, then read to the finish; (stream, every token id read, the error that ended it or None)."""
    async def run():
        stream = await Dispatcher(engines, Router()).open(req)
        ids, msg = list(stream.first.token_ids), stream.first
        try:
            while not msg.finish_reason:
                msg = await stream.read()
                ids.extend(msg.token_ids)
        except APIError as err:
            return stream, ids, err
        finally:
            stream.cancel()
        return stream, ids, None

    return asyncio.run(run())


def migrations_counted(frm: str, to: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("hybridserve_request_migrations_total", {"from": frm, "to": to}) or 0.0


@pytest.mark.parametrize("lost", [rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"),
                                  rpc_error(grpc.StatusCode.UNKNOWN, "Stream removed"), None],
                         ids=["unavailable", "stream-removed", "stream-ended"])
def test_a_lost_decode_engine_migrates_prompt_and_tokens_so_far_to_the_engine_left(lost):
    before = migrations_counted("hybrid", "gpu")
    hybrid = [token(11), token(12)] + ([lost] if lost else [])  # None: the stream just ends
    engines = FakeEngines(scripts={"fpga": [hybrid], "gpu": [[token(13), token(14), token(15, "length")]]})
    engines.alive["fpga"] = False  # a health check finds decode_fpga gone
    stream, ids, err = read_all(engines, request("hybrid", prompt_len=3, max_tokens=5, temperature=0.7, seed=9))
    assert err is None and ids == [11, 12, 13, 14, 15]  # none twice, none missing
    [(_, first, _, old), (engine, rest, _, _)] = engines.calls
    assert old.cancelled and engine == "gpu" and rest.mode == pb.MODE_GPU
    assert list(rest.prompt_token_ids) == [1, 2, 3, 11, 12] and rest.sampling.max_tokens == 3
    assert rest.request_id == "cmpl-test-m1" and (rest.sampling.seed, rest.sampling.top_k) == (9, first.sampling.top_k)
    assert (stream.decision.mode, stream.decision.reason) == ("gpu", "migration")
    assert [(mg.from_mode, mg.to_mode, mg.after_tokens) for mg in stream.migrations] == [("hybrid", "gpu", 2)]
    assert migrations_counted("hybrid", "gpu") == before + 1


def test_a_failure_with_every_engine_up_is_not_a_migration():
    engines = FakeEngines(scripts={"fpga": [[token(1), rpc_error(grpc.StatusCode.UNKNOWN)]]})
    stream, ids, err = read_all(engines, request())
    assert (err.status, err.code) == (500, "engine_error") and len(engines.calls) == 1 and not stream.migrations
    assert sorted(engines.checked) == ["fpga", "gpu"]


@pytest.mark.parametrize("code", sorted(NEVER_MIGRATE, key=lambda c: c.name))
def test_a_failure_about_the_request_is_never_migrated(code):
    engines = FakeEngines(scripts={"fpga": [[token(1), rpc_error(code)]]})
    engines.alive["fpga"] = False
    _, _, err = read_all(engines, request())
    assert err is not None and len(engines.calls) == 1 and not engines.checked


def test_unavailable_migrates_away_from_its_mode_even_when_health_says_up():
    engines = FakeEngines(scripts={"gpu": [[token(1), rpc_error(grpc.StatusCode.UNAVAILABLE)]],
                                   "fpga": [[token(2, "length")]]})
    stream, ids, err = read_all(engines, request("gpu", max_tokens=2))
    assert err is None and ids == [1, 2] and stream.decision.mode != "gpu"


def test_both_engines_lost_is_503_after_the_tokens_already_out():
    engines = FakeEngines(scripts={"fpga": [[token(1), rpc_error(grpc.StatusCode.UNAVAILABLE)]]})
    engines.alive = {"gpu": False, "fpga": False}
    _, ids, err = read_all(engines, request())
    assert ids == [1] and (err.status, err.code) == (503, "engine_unavailable") and len(engines.calls) == 1


def test_a_second_loss_migrates_again_and_never_back_to_a_mode_that_failed():
    engines = FakeEngines(scripts={"fpga": [[token(1), rpc_error(grpc.StatusCode.UNAVAILABLE)],
                                            [token(3), rpc_error(grpc.StatusCode.UNAVAILABLE)]],
                                   "gpu": [[token(2), rpc_error(grpc.StatusCode.UNAVAILABLE)]]})
    stream, ids, err = read_all(engines, request("hybrid", max_tokens=6))
    # hybrid -> (gpu or fpga) -> the one left; then nothing is left
    assert ids[:3] in ([1, 2, 3], [1, 3, 2]) and err.status == 503
    modes = [mg.to_mode for mg in stream.migrations]
    assert len(modes) == 2 and len(set(modes) | {"hybrid"}) == 3
    assert [list(r.prompt_token_ids)[5:] for _, r, _, _ in engines.calls] == [[], ids[:1], ids[:2]]
    assert [r.sampling.max_tokens for _, r, _, _ in engines.calls] == [6, 5, 4]


def test_a_loss_after_the_last_token_only_finishes_the_request():
    engines = FakeEngines(scripts={"fpga": [[token(1), token(2), rpc_error(grpc.StatusCode.UNAVAILABLE)]]})
    engines.alive["fpga"] = False
    stream, ids, err = read_all(engines, request(max_tokens=2))
    assert err is None and ids == [1, 2] and len(engines.calls) == 1


def chosen(t: int, index: int, finish: str = "") -> pb.GenerateResponse:
    return pb.GenerateResponse(token_ids=[t], finish_reason=finish, index=index)


def test_a_lost_call_of_several_choices_continues_each_unfinished_choice_in_a_call_of_its_own():
    # choice 1 finished before the loss; choices 0 and 2 continue from their own tokens, in their own streams
    lost = [chosen(10, 0), chosen(20, 1), chosen(30, 2), chosen(21, 1, "stop"), chosen(11, 0),
            rpc_error(grpc.StatusCode.UNAVAILABLE)]
    engines = FakeEngines(scripts={"fpga": [lost], "gpu": [[chosen(12, 0, "length")], [chosen(31, 0),
                                                                                       chosen(32, 0, "length")]]})
    engines.alive["fpga"] = False

    async def run():
        stream = await Dispatcher(engines, Router()).open(request("hybrid", max_tokens=3, n=3, seed=4,
                                                                  temperature=1.0))
        got, msg = [(stream.first.index, list(stream.first.token_ids))], stream.first
        finished = set()
        while len(finished) < 3:
            msg = await stream.read()
            got.append((msg.index, list(msg.token_ids)))
            if msg.finish_reason:
                finished.add(msg.index)
        stream.cancel()
        return stream, got

    stream, got = asyncio.run(run())
    per_choice = {i: [t for j, ts in got if j == i for t in ts] for i in range(3)}
    assert per_choice == {0: [10, 11, 12], 1: [20, 21], 2: [30, 31, 32]}
    [_, (_, rest0, _, _), (_, rest2, _, _)] = engines.calls
    assert list(rest0.prompt_token_ids)[5:] == [10, 11] and rest0.sampling.max_tokens == 1
    assert list(rest2.prompt_token_ids)[5:] == [30] and rest2.sampling.max_tokens == 2
    assert [(r.sampling.n, r.sampling.first_choice, r.sampling.seed) for r in (rest0, rest2)] == [(1, 0, 4), (1, 2, 4)]
    assert [(mg.to_mode, mg.after_tokens) for mg in stream.migrations] == [("gpu", 2), ("gpu", 1)]
