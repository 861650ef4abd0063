"""The per-row arithmetic both engines share: logprobs (against torch's log_softmax) and the sampling
controls (against their definitions written out), and the loop taking the logits path for them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.logits_processing import process, processes
from services.engine.logprobs import token_logprob
from services.engine.sampling import Sampler, SamplingParams


def test_token_logprob_is_torch_log_softmax_and_its_top_k():
    logits = np.random.default_rng(0).normal(0, 3, 1000).astype(np.float32)
    logits[[10, 20]] = logits.max() + 1  # a tie at the top: the lower id first
    ref = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1).numpy()
    lp = token_logprob(logits, 7, 5)
    assert abs(lp.logprob - ref[7]) < 1e-6
    order = np.lexsort((np.arange(1000), -ref))[:5]
    assert [t for t, _ in lp.top] == order.tolist() and lp.top[0][0] == 10
    assert np.allclose([v for _, v in lp.top], ref[order], atol=1e-6)
    assert token_logprob(logits, 7, 0).top == ()
    # ties across the k-th place: the lowest ids of the tied ones, whichever argpartition would pick
    flat = np.zeros(1000, np.float32)
    flat[[500, 900]] = 1.0
    assert [t for t, _ in token_logprob(flat, 0, 5).top] == [500, 900, 0, 1, 2]


def test_each_control_does_what_its_definition_says():
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0], np.float32)
    prompt, out = [0, 4], [3, 3, 1]
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0,
                       logit_bias=((2, 1.5),), min_tokens=4)
    got = process(logits, p, prompt + out, len(prompt), frozenset({2}))
    want = logits.copy()
    want[2] += 1.5                     # bias
    want[2] = -np.inf                  # min_tokens: 3 < 4 tokens out, 2 is a stop token
    for t in {0, 4, 3, 1}:             # repetition: prompt and output
        want[t] = want[t] / 2 if want[t] > 0 else want[t] * 2
    want[3] -= 2 * 0.5 + 0.25          # frequency x2, presence
    want[1] -= 1 * 0.5 + 0.25
    assert np.array_equal(got, want) and logits[2] == 0.5  # the engine's row is left alone
    assert not processes(SamplingParams()) and processes(SamplingParams(min_tokens=1))
    # past min_tokens the stop token may come
    assert np.isfinite(process(logits, p, prompt + out + [0], len(prompt), frozenset({2}))[2])


def test_greedy_with_a_control_or_logprobs_leaves_the_device_argmax():
    assert SamplingParams(temperature=0).device_greedy
    for kw in ({"logprobs": 0}, {"presence_penalty": 0.1}, {"logit_bias": ((1, 2.0),)}, {"min_tokens": 1},
               {"repetition_penalty": 1.1}):
        assert not SamplingParams(temperature=0, **kw).device_greedy, kw
        # logprobs alone keep the device's argmax on an engine that computes them there (plain greedy)
        assert SamplingParams(temperature=0, **kw).plain_greedy == ("logprobs" in kw), kw
    assert not SamplingParams(temperature=0.5, logprobs=1).plain_greedy
    assert not SamplingParams(temperature=0, logprobs=1, grammar="start: /a/").plain_greedy


def test_pick_applies_the_controls_and_reports_the_raw_logprob():
    logits = np.array([1.0, 3.0, 2.0], np.float32)
    sampler = Sampler(SamplingParams(temperature=0, logit_bias=((1, -5.0),), logprobs=1))
    token, lp = sampler.pick(logits, [0], 1, frozenset())
    ref = torch.log_softmax(torch.from_numpy(logits), dim=-1).numpy()
    assert token == 2 and abs(lp.logprob - ref[2]) < 1e-6 and lp.top[0][0] == 1  # the model's own best


@pytest.mark.parametrize("bad", [{"logprobs": 21}, {"frequency_penalty": 3}, {"repetition_penalty": -1},
                                 {"logit_bias": ((1, 101.0),)}, {"min_tokens": -1}])
def test_out_of_range_controls_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
