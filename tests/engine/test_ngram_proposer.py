"""The n-gram proposer (services/engine/ngram_proposer.py): exact drafts from a sequence's own tokens, the
longest n first, the latest occurrence, and the back-off of a request whose drafts are rejected."""
from __future__ import annotations

import random

import pytest

from services.engine.batching_settings import BatchingSettings
from services.engine.ngram_proposer import Acceptance, NgramConfig, NgramIndex
from services.engine.speculation import SpeculationConfig


def index(tokens, **kw) -> NgramIndex:
    ix = NgramIndex(NgramConfig(**kw))
    ix.extend(tokens)
    return ix


def test_the_tokens_after_the_latest_earlier_occurrence_are_proposed():
    #             0  1  2  3  4  5  6  7  8  9
    ix = index([5, 6, 7, 8, 9, 1, 5, 6, 7], n_min=2, n_max=3, k=3)
    assert ix.propose() == [8, 9, 1]  # "5 6 7" ended at 2 before: what followed it
    ix.extend([8])
    assert ix.propose() == [9, 1, 5]
    assert ix.propose(k=1) == [9] and ix.propose(k=0) == []


def test_the_longest_n_wins_and_then_the_latest_occurrence():
    # "2 3" occurs twice before the end; "1 2 3" once: the 3-gram's continuation wins
    ix = index([1, 2, 3, 40, 7, 2, 3, 50, 1, 2, 3], n_min=2, n_max=3, k=1)
    assert ix.propose() == [40]
    ix = index([1, 2, 3, 40, 7, 2, 3, 50, 9, 2, 3], n_min=2, n_max=3, k=1)
    assert ix.propose() == [50]  # only the 2-gram matches: its latest earlier occurrence


def test_nothing_repeated_proposes_nothing_and_n_min_bounds_the_match():
    assert index(list(range(20))).propose() == []
    assert index([1, 2, 9, 1], n_min=2).propose() == []  # one repeated token is no 2-gram
    assert index([1, 2, 9, 1], n_min=1, n_max=2).propose() == [2, 9, 1]


@pytest.mark.parametrize("n_max", [4, 8])
def test_an_incremental_index_proposes_what_a_full_scan_finds(n_max):
    rng = random.Random(7)
    tokens = [rng.randrange(6 if n_max == 4 else 3) for _ in range(400)]  # fewer symbols: long n-grams recur
    ix = NgramIndex(NgramConfig(n_min=2, n_max=n_max, k=3))
    for end in range(len(tokens)):
        ix.extend(tokens[end:end + 1])
        assert ix.propose() == scan(tokens[:end + 1], 2, n_max, 3), end


def test_the_default_n_max_tells_apart_two_places_a_short_phrase_recurs():
    """A table's rows or a code's lines repeat short phrases: the 4 tokens before the end also ended an
    unrelated later row, and only the 6 before it find the row being copied. The served default (8) follows
    the row; 4, the default until the copy-heavy benchmark measured both, took the wrong one."""
    copied = [1, 2, 3, 4, 5, 6, 100, 101, 102]
    other = [9, 3, 4, 5, 6, 200, 201, 202]
    tokens = copied + other + [1, 2, 3, 4, 5, 6]
    default = BatchingSettings().speculative_n_max
    assert default == SpeculationConfig().n_max == NgramConfig().n_max
    assert index(tokens, n_min=2, n_max=default, k=3).propose() == [100, 101, 102]
    assert index(tokens, n_min=2, n_max=4, k=3).propose() == [200, 201, 202]


def scan(tokens, n_min, n_max, k):
    """The reference: for the longest n, the latest earlier end of the suffix n-gram, by brute force."""
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def test_bad_configs_are_refused():
    with pytest.raises(ValueError):
        NgramConfig(n_min=3, n_max=2)
    with pytest.raises(ValueError):
        NgramConfig(k=0)


def test_rejected_drafts_pause_a_request_longer_each_time_and_an_accepted_one_resets():
    a = Acceptance(patience=2, pause=3, max_pause=6)
    a.observe(4, 0)
    assert a.wants_drafts()  # one miss: patience
    a.observe(4, 0)
    assert [a.wants_drafts() for _ in range(4)] == [False, False, False, True]
    a.observe(4, 0), a.observe(4, 0)
    assert [a.wants_drafts() for _ in range(7)] == [False] * 6 + [True]  # doubled
    a.observe(4, 0), a.observe(4, 0)
    assert [a.wants_drafts() for _ in range(7)] == [False] * 6 + [True]  # capped at max_pause
    a.observe(4, 2)  # accepted: back to the first pause next time
    a.observe(4, 0), a.observe(4, 0)
    assert [a.wants_drafts() for _ in range(4)] == [False, False, False, True]
    a.observe(0, 0)  # a step with no drafts says nothing
    assert a.wants_drafts()


def test_the_draft_length_follows_what_was_accepted():
    a = Acceptance()
    assert a.length(8) == 8  # nothing known: as many as asked
    a.observe(8, 2)
    assert a.length(8) == 3  # two accepted: one more than that next time
    a.observe(3, 3)
    assert a.length(8) == 6 and a.length(4) == 4  # all accepted: twice as many, within what is asked
    a.observe(6, 6)
    assert a.length(8) == 8
