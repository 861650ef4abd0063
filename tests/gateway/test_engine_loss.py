"""Engines lost mid-request, and the gateway's drain, on a real stack of its own.

* An engine SIGKILLed in the middle of a greedy completion: the gateway migrates the request to
  the engine left, the client's text is the uninterrupted run's (no token twice, none missing),
  the migration is counted, logged and said in the response. The engines draft (n-gram
  speculation) and the greedy completion copies its prompt, so the migrated stream also has the text
  of a run without drafts. A seeded request of two choices running beside it (drafts off): each
  choice continues where it was, with its own random stream.
* Both engines gone: a stream ends with an error event then `[DONE]`; a plain request gets 503
  with Retry-After.
* SIGTERM to the gateway with a stream in flight: /health says 503, a new request gets 503, the
  stream finishes, the process exits.

The tests kill engines, so the module starts its own; `engines_as` brings them to the state a
test needs (restarting one that a test before it killed).
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from services.decode_fpga.settings import DecodeSettings
from services.gateway.settings import GatewaySettings
from services.prefill_gpu.settings import PrefillSettings
from tests.services_harness import engine_pair, start_gateway, wait_http_ok

pytestmark = pytest.mark.slow

PROMPT = "The history of the printing press begins"
# a text the model copies, so that n-gram drafts are accepted before and after a migration
COPY_PROMPT = ("Repeat this exactly: The river runs past the old mill, under the stone bridge and into the "
               "valley where the farmers keep their sheep. The river runs past the old mill, under the stone "
               "bridge and into the valley where the farmers keep their sheep. The river")
SPECULATIVE_K = "4"
N_TOKENS = 96  # long enough that a kill after KILL_AFTER chunks lands mid-decode
KILL_AFTER = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory, profile_cache):
    tmp = tmp_path_factory.mktemp("engine_loss")
    prefill, decode = engine_pair(tmp, {PrefillSettings.env_name("arena_bytes"): str(32 << 20),
                                        "HYBRIDSERVE_PREFILL_SPECULATIVE_K": SPECULATIVE_K,
                                        "HYBRIDSERVE_PREFILL_SPECULATIVE_MAX_BATCH": "4"},
                                  {DecodeSettings.env_name("max_context"): "1024",
                                   # 3: the migration test runs a request of two choices beside one of one
                                   DecodeSettings.env_name("max_sequences"): "3",
                                   "HYBRIDSERVE_DECODE_SPECULATIVE_K": SPECULATIVE_K,
                                   "HYBRIDSERVE_DECODE_SPECULATIVE_MAX_BATCH": "4"}, profile_cache)
    gateway = start_gateway(tmp, prefill, decode)
    try:
        # start-up (model load, kernel build) takes minutes when other work holds the two cores
        prefill.wait_healthy(timeout=420)
        decode.wait_healthy(timeout=420)
        wait_http_ok(gateway)
        url = f"http://127.0.0.1:{gateway.port}"
        yield {"prefill": prefill, "decode": decode, "gateway": gateway, "url": url, "tmp": tmp,
               "model": httpx.get(url + "/v1/models").json()["data"][0]["id"]}
    finally:
        gateway.stop()
        decode.stop()
        prefill.stop()


def engines_as(stack, prefill_up: bool, decode_up: bool) -> None:
    """Kill or restart engines until they are as asked and the gateway's health loop has seen it."""
    for name, want in (("prefill", prefill_up), ("decode", decode_up)):
        svc = stack[name]
        alive = svc.proc.poll() is None
        if alive and not want:
            svc.stop(sig=signal.SIGKILL)
        elif want and not alive:
            svc.start().wait_healthy(timeout=420)  # same ports: the gateway's channels reconnect
    expected = {"prefill_gpu": "up" if prefill_up else "down", "decode_fpga": "up" if decode_up else "down"}
    deadline = time.monotonic() + 60
    while httpx.get(stack["url"] + "/health", timeout=10).json()["engines"] != expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway never saw the engines as {expected}")
        time.sleep(0.2)


def body(stack, mode: str, stream: bool, max_tokens: int = N_TOKENS) -> dict:
    return {"model": stack["model"], "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "mode": mode, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}


def stream_events(stack, payload: dict, on_chunk=lambda n: None) -> list:
    """The stream's events in order (parsed JSON, or "[DONE]"); `on_chunk(n)` after the n-th text chunk."""
    events, n_text = [], 0
    with httpx.stream("POST", stack["url"] + "/v1/completions", json=payload, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if data != "[DONE]" and events[-1].get("choices") and events[-1]["choices"][0]["text"]:
                n_text += 1
                on_chunk(n_text)
    return events


def text_of(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


def metric(stack, name: str, labels: str) -> float:
    for line in httpx.get(stack["url"] + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def migrations(stack, frm: str, to: str) -> float:
    return metric(stack, "hybridserve_request_migrations_total", f'from="{frm}",to="{to}"')


# ---- drain (first: it needs both engines, and a gateway of its own to stop) ------------------
def test_sigterm_drains_the_gateway_and_the_stream_in_flight_finishes(stack):
    engines_as(stack, True, True)
    own = stack["tmp"] / "drained"
    own.mkdir(exist_ok=True)
    gw = start_gateway(own, stack["prefill"], stack["decode"], {GatewaySettings.env_name("drain_grace_s"): "120"})
    try:
        wait_http_ok(gw)
        url = f"http://127.0.0.1:{gw.port}"
        first_chunk, result = threading.Event(), {}

        def long_stream():
            try:
                # fpga mode: its decode steps are the quickest here (gpu mode's took ~60 s for the 400
                # tokens on a busy machine); 400 of them still outlast the checks below many times over
                result["events"] = stream_events({**stack, "url": url}, body(stack, "fpga", True, max_tokens=400),
                                                 on_chunk=lambda n: first_chunk.set())
            except Exception as exc:  # noqa: BLE001 - the assertion below reports it
                result["error"] = exc
            first_chunk.set()

        reader = threading.Thread(target=long_stream)
        reader.start()
        first_chunk.wait(300)
        gw.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while (health := httpx.get(url + "/health", timeout=10)).status_code != 503:
            assert time.monotonic() < deadline, "/health never turned 503 after SIGTERM"
            time.sleep(0.05)
        assert health.json()["status"] == "draining"
        refused = httpx.post(url + "/v1/completions", json=body(stack, "gpu", False, max_tokens=2), timeout=30)
        assert reader.is_alive(), "the stream ended before the drain could be seen; make it longer"
        assert refused.status_code == 503 and refused.headers["retry-after"].isdigit()
        assert refused.json()["error"]["code"] == "shutting_down"
        reader.join(300)
        assert "error" not in result, result.get("error")
        events = result["events"]
        assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
        finish = [e for e in events if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]
        assert finish[-1]["choices"][0]["finish_reason"] == "length" and events[-2]["usage"]["completion_tokens"] == 400
        gw.proc.wait(60)  # the process exits once nothing is in flight
    finally:
        gw.stop()


# ---- migration --------------------------------------------------------------------------------
def choice_texts(events: list, n: int) -> list[str]:
    return ["".join(ch["text"] for e in events if isinstance(e, dict) for ch in e.get("choices", ()) if ch["index"] == i)
            for i in range(n)]


def migrations_of(events: list) -> list[dict]:
    return next(e["hybridserve"] for e in events if isinstance(e, dict) and e.get("hybridserve"))["migrations"]


def copying(payload: dict) -> dict:
    """`payload` with the prompt the model copies (its drafts accepted)."""
    return {**payload, "prompt": COPY_PROMPT}


def kill_decode_mid_stream(stack, several: dict) -> tuple[list, list]:
    """decode_fpga SIGKILLed after KILL_AFTER chunks of a greedy hybrid stream while a request of
    several choices streams beside it: both requests' events."""
    engines_as(stack, True, True)
    beside, going = {}, threading.Event()
    worker = threading.Thread(target=lambda: beside.update(events=stream_events(stack, several,
                                                                                on_chunk=lambda n: going.set())))
    worker.start()
    assert going.wait(300), "the request of two choices never streamed"

    def kill(n):
        if n == KILL_AFTER:
            stack["decode"].stop(sig=signal.SIGKILL)

    events = stream_events(stack, copying(body(stack, "hybrid", True)), on_chunk=kill)
    worker.join(300)
    assert stack["decode"].proc.poll() is not None
    return events, beside["events"]


def test_decode_fpga_killed_mid_stream_the_streams_go_on_on_prefill_gpu_with_the_same_tokens(stack):
    # beside the greedy stream, one of two seeded choices (each its own random stream, which its
    # continuation draws on), running when the same kill lands: one restart of decode_fpga for both
    # (as long as the greedy stream: with 48 tokens, on a busy machine, it once ended before the kill landed)
    several = {**body(stack, "hybrid", True, max_tokens=N_TOKENS), "n": 2, "temperature": 1.0, "seed": 3,
               "speculative": False}
    engines_as(stack, True, True)
    reference = stream_events(stack, copying(body(stack, "hybrid", True)))
    # greedy: the text without drafts, and with them
    assert text_of(stream_events(stack, {**copying(body(stack, "hybrid", True)), "speculative": False})) == \
        text_of(reference)
    assert reference[-2]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    several_reference = choice_texts(stream_events(stack, several), 2)
    assert several_reference[0] != several_reference[1]
    before = migrations(stack, "hybrid", "gpu")

    events, beside = kill_decode_mid_stream(stack, several)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
    assert text_of(events) == text_of(reference) and events[-2]["usage"]["completion_tokens"] == N_TOKENS
    [moved] = migrations_of(events)
    assert (moved["from_mode"], moved["to_mode"]) == ("hybrid", "gpu")
    assert KILL_AFTER <= moved["after_tokens"] < N_TOKENS
    assert "migrated from hybrid to gpu mode" in stack["gateway"].log_path.read_text()
    # the two choices: each continued in a call of its own, where it was
    assert beside[-1] == "[DONE]" and not any("error" in e for e in beside if isinstance(e, dict))
    assert beside[-2]["usage"]["completion_tokens"] == 2 * N_TOKENS
    moves = migrations_of(beside)
    assert [(mg["from_mode"], mg["to_mode"]) for mg in moves] == [("hybrid", "gpu")] * 2, "the kill came too late"
    assert migrations(stack, "hybrid", "gpu") == before + 3
    if choice_texts(beside, 2) != several_reference:
        # A sampled token whose uniform falls within rounding of a boundary of the CDF can come out
        # as its neighbour when the continuation's engine (torch) computes the logits in another
        # order than the reference's (OpenCL): seen once in a full run (2026-11-28), the second
        # choice equal to its reference for its first ~50 tokens, well past the kill. A wrong stream or
        # position diverges on every run, so a second kill must give the reference's texts.
        _, beside = kill_decode_mid_stream(stack, several)
        assert choice_texts(beside, 2) == several_reference
        assert len(migrations_of(beside)) == 2, "the second kill came too late"


def test_prefill_gpu_killed_mid_request_the_answer_comes_from_decode_fpga_and_says_so(stack):
    engines_as(stack, True, True)
    url = stack["url"] + "/v1/completions"
    reference = httpx.post(url, json=body(stack, "gpu", False), timeout=300).json()["choices"][0]["text"]
    before = migrations(stack, "gpu", "fpga")
    first_tokens = lambda: metric(stack, "hybridserve_time_to_first_token_seconds_count", 'mode="gpu"')  # noqa: E731
    started = first_tokens()
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=httpx.post(url, json=body(stack, "gpu", False),
                                                                        timeout=300)))
    worker.start()
    while first_tokens() == started:  # the gateway has the request's first token: prefill_gpu is decoding
        assert worker.is_alive(), "the request ended before its first token was seen"
        time.sleep(0.02)
    stack["prefill"].stop(sig=signal.SIGKILL)
    worker.join(300)
    r = result["r"]
    assert r.status_code == 200, r.text
    moves = r.headers.get("x-hybridserve-migrations", "")
    assert moves.startswith("gpu->fpga@"), f"no migration (the request finished before the kill?): {moves!r}"
    assert r.json()["choices"][0]["text"] == reference and r.json()["usage"]["completion_tokens"] == N_TOKENS
    assert r.json()["hybridserve"]["migrations"][0]["after_tokens"] == int(moves.split("@")[1])
    assert migrations(stack, "gpu", "fpga") == before + 1


# ---- both engines lost ------------------------------------------------------------------------
def test_both_engines_lost_mid_stream_is_an_error_event_then_done(stack):
    engines_as(stack, False, True)

    def kill(n):
        if n == KILL_AFTER:
            stack["decode"].stop(sig=signal.SIGKILL)

    events = stream_events(stack, body(stack, "fpga", True), on_chunk=kill)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert (error["code"], error["type"]) == ("engine_unavailable", "service_unavailable_error")
    assert len(text_of(events)) > 0  # the tokens before the loss were sent


def test_both_engines_down_a_plain_request_gets_503_with_retry_after(stack):
    engines_as(stack, False, False)
    r = httpx.post(stack["url"] + "/v1/completions", json=body(stack, "auto", False), timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"].isdigit()
    assert r.json()["error"]["code"] == "engine_unavailable"
