"""The host sampler: greedy, temperature, top-k, top-p, seeds, and the one-draw-per-token rule."""
from __future__ import annotations

import numpy as np
import pytest

from services.engine.sampling import Sampler, SamplingParams


def test_greedy_takes_first_max():
    assert Sampler(SamplingParams(temperature=0)).sample(np.array([1.0, 3.0, 3.0, 0.0], np.float32), 0) == 1


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    best = int(np.argmax(logits))
    for params in (SamplingParams(top_k=1, seed=1), SamplingParams(top_p=1e-6, seed=1)):
        s = Sampler(params)
        assert {s.sample(logits, i) for i in range(50)} == {best}


def test_temperature_one_follows_softmax():
    logits = np.log(np.array([1.0, 3.0], np.float32))  # p = [0.25, 0.75]
    s = Sampler(SamplingParams(seed=123))
    share = np.mean([s.sample(logits, i) for i in range(4000)])  # a draw per position
    assert abs(share - 0.75) < 0.03


def test_top_k_never_samples_outside_the_k_best():
    logits = np.arange(10, dtype=np.float32)
    s = Sampler(SamplingParams(top_k=3, temperature=2.0, seed=5))
    assert {s.sample(logits, i) for i in range(300)} == {7, 8, 9}


def test_a_tokens_randomness_is_keyed_by_seed_choice_and_position_only():
    logits = np.random.default_rng(1).normal(size=50).astype(np.float32)
    a, b = Sampler(SamplingParams(seed=9)), Sampler(SamplingParams(seed=9))
    first = [a.sample(logits, position=p) for p in range(10, 30)]
    # another sampler (another engine, or a migrated continuation) starting mid-way draws the same
    assert [b.sample(logits, position=p) for p in range(20, 30)] == first[10:]
    other_choice = Sampler(SamplingParams(seed=9), stream=1)
    assert [other_choice.sample(logits, position=p) for p in range(10, 30)] != first
    assert [Sampler(SamplingParams(seed=10)).sample(logits, position=p) for p in range(10, 30)] != first


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1}, {"temperature": 2.5},
                                    {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}])
def test_invalid_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
