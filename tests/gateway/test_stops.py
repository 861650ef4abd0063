"""The stop strings' matcher on its own: text held back while it may begin a stop string, the text cut
at the earliest stop, and (vLLM's include_stop_str_in_output) the stop string kept."""
from __future__ import annotations

import pytest

from services.gateway.output.stops import StopMatcher


def fed(matcher: StopMatcher, pieces: list[str]) -> str:
    return "".join(matcher.feed(p) for p in pieces) + matcher.flush()


@pytest.mark.parametrize("pieces", [["Hello wor", "ld. Bye"], ["Hel", "lo", " w", "o", "rld", ". Bye"],
                                    ["Hello world. Bye"]])
def test_the_text_ends_before_the_stop_or_with_it_however_it_was_chunked(pieces):
    assert fed(StopMatcher(["world"]), pieces) == "Hello "
    assert fed(StopMatcher(["world"], include=True), pieces) == "Hello world"


def test_the_earliest_stop_wins_and_of_two_there_the_longer_is_kept():
    assert fed(StopMatcher(["Bye", "wor"], include=True), ["Hello world. Bye"]) == "Hello wor"
    assert fed(StopMatcher(["wo", "world"], include=True), ["Hello world"]) == "Hello world"
    assert fed(StopMatcher(["wo", "world"]), ["Hello world"]) == "Hello "


def test_text_without_a_stop_comes_out_whole():
    m = StopMatcher(["zz"], include=True)
    assert fed(m, ["a z", "b"]) == "a zb" and not m.stopped
