"""The Generate call's messages (service.messages_of) over the real engine loop: one token per
message while the reader keeps up, every ready token in one message once it is behind."""
from __future__ import annotations

import time

import pytest

from services.engine.requests import Cancellation, RequestTimings
from services.engine.runtime import stream_tokens
from services.engine.service import messages_of
from tests.engine.paged_fake import reference
from tests.engine.test_engine_loop import GREEDY, make_loop


@pytest.fixture
def loop():
    _, loop = make_loop()
    yield loop
    loop.close()


def events(loop, prompt):
    stream = loop.submit(prompt, GREEDY)
    return stream, stream_tokens(stream, RequestTimings(), Cancellation())


def test_a_reader_behind_the_loop_gets_the_ready_tokens_in_one_message(loop):
    prompt = [3, 1, 4, 1, 5]
    stream, evs = events(loop, prompt)
    deadline = time.monotonic() + 10
    while not stream.done and time.monotonic() < deadline:  # the reader is late: every token is made
        time.sleep(0.005)
    msgs = list(messages_of(evs))
    assert len(msgs) == 1  # one message per token (12) before
    assert list(msgs[0].token_ids) == reference(prompt, GREEDY.max_tokens)
    assert msgs[0].finish_reason == "length"


def test_a_reader_that_keeps_up_gets_one_token_per_message():
    # steps of 30 ms: a reader on a busy machine (the suite's two lanes on two cores) still keeps up;
    # at 2 ms it fell behind there and got 5 messages for 12 tokens
    engine, loop = make_loop()
    engine.step_s = 0.03
    prompt = [2, 7, 1, 8]
    try:
        _, evs = events(loop, prompt)
        msgs = list(messages_of(evs))  # read as the loop makes them
    finally:
        loop.close()
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == reference(prompt, GREEDY.max_tokens)
    assert len(msgs) >= GREEDY.max_tokens // 2  # mostly one each: nothing waits to be batched
    assert [m.finish_reason for m in msgs][-1] == "length" and not any(m.finish_reason for m in msgs[:-1])


def test_tokens_held_for_one_message_are_sent_before_a_failure_ends_the_call():
    from services.engine.token_event import TokenEvent
    from services.errors import EngineStepFailed

    def events():
        yield TokenEvent(11, None, more=True)
        yield TokenEvent(12, None, more=True)
        raise EngineStepFailed("the engine failed while serving the request")

    msgs = messages_of(events())
    assert list(next(msgs).token_ids) == [11, 12]
    with pytest.raises(EngineStepFailed):
        next(msgs)
