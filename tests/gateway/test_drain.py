"""The drain's gate and state, driven as ASGI in this process (the live drain is in test_engine_loss.py).

The app behind the gate is a few lines of ASGI written here: the gate's contract is about ASGI
messages (what reaches `send`, when), so that is what these tests speak.
"""
from __future__ import annotations

import asyncio
import json

from services.gateway.api.drain import Drain, DrainGate
from services.gateway.api.server import DrainingServer, config
from services.gateway.settings import GatewaySettings


def scope(path: str = "/v1/completions") -> dict:
    return {"type": "http", "path": path, "method": "POST", "headers": []}


async def receive():
    await asyncio.sleep(3600)  # no body and no disconnect: the tests end the request themselves


class Sent(list):
    async def __call__(self, message):
        self.append(message)

    def status(self) -> int:
        return next(m["status"] for m in self if m["type"] == "http.response.start")

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self if m["type"] == "http.response.body")

    def header(self, name: bytes) -> bytes | None:
        start = next(m for m in self if m["type"] == "http.response.start")
        return dict(start["headers"]).get(name)


def streaming_app(release: asyncio.Event, chunks: int = 1):
    """An event stream that sends `chunks` events, then waits for `release` before its end."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for i in range(chunks):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
    return app


def test_draining_refuses_new_work_with_503_and_lets_health_and_metrics_through():
    async def run():
        drain = Drain(grace_s=60)
        release = asyncio.Event()
        release.set()
        gate = DrainGate(streaming_app(release), drain)
        drain.begin()
        refused, health = Sent(), Sent()
        await gate(scope(), receive, refused)
        await gate(scope("/health"), receive, health)
        return refused, health

    refused, health = asyncio.run(run())
    assert refused.status() == 503 and refused.header(b"retry-after").isdigit()
    assert refused.header(b"connection") == b"close"
    error = json.loads(refused.body())["error"]
    assert (error["code"], error["type"]) == ("shutting_down", "service_unavailable_error")
    assert health.status() == 200 and health.body().endswith(b"[DONE]\n\n")


def test_a_request_in_flight_finishes_and_the_drain_waits_for_its_last_byte():
    async def run():
        drain = Drain(grace_s=60)
        release = asyncio.Event()
        gate = DrainGate(streaming_app(release), drain)
        sent = Sent()
        request = asyncio.create_task(gate(scope(), receive, sent))
        while not sent:
            await asyncio.sleep(0)
        drain.begin()
        in_flight = (drain.in_flight, drain.finished())
        release.set()
        await request
        return sent, in_flight, (drain.in_flight, drain.finished())

    sent, during, after = asyncio.run(run())
    assert during == (1, False) and after == (0, True)
    assert sent.status() == 200 and sent.body() == b"data: 0\n\ndata: [DONE]\n\n"


def test_past_the_grace_a_started_stream_ends_with_an_error_event_then_done_and_an_unstarted_one_gets_503():
    async def never_answers(scope, receive, send):
        await asyncio.sleep(3600)

    async def run():
        drain = Drain(grace_s=0.0)  # over as soon as it begins
        stream_gate, silent_gate = DrainGate(streaming_app(asyncio.Event(), chunks=2), drain), \
            DrainGate(never_answers, drain)
        stream, silent = Sent(), Sent()
        tasks = [asyncio.create_task(stream_gate(scope(), receive, stream)),
                 asyncio.create_task(silent_gate(scope(), receive, silent))]
        while len(stream) < 3:
            await asyncio.sleep(0)
        drain.begin()
        assert not drain.finished()  # the grace is over: this sets `expired`, the gates end their requests
        await asyncio.gather(*tasks)
        return stream, silent, drain.finished()

    stream, silent, finished = asyncio.run(run())
    assert finished
    body = stream.body().decode()
    assert body.startswith("data: 0\n\ndata: 1\n\n") and body.endswith("data: [DONE]\n\n")
    error = json.loads(body.split("\n\n")[2][len("data: "):])["error"]
    assert error["code"] == "shutting_down" and stream[-1]["more_body"] is False
    assert silent.status() == 503


def test_the_server_drains_with_the_grace_from_the_settings():
    settings = GatewaySettings.from_environ({"HYBRIDSERVE_GATEWAY_DRAIN_GRACE_S": "7"})
    cfg = config(settings)
    server = DrainingServer(cfg, cfg.app.state.drain)
    assert server.drain.grace_s == 7 and GatewaySettings().drain_grace_s == 60
    server.handle_exit(15, None)  # SIGTERM: a drain, not an exit
    assert server.drain.draining and not server.should_exit
    server.handle_exit(15, None)  # a second one: exit now
    assert server.should_exit
