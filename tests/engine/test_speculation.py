"""Speculation's engine-neutral part (services/engine/speculation.py) against a toy target: verification
emits what one-token-at-a-time decoding emits (greedy and seeded), the emitted token's distribution is the
target's with the acceptance rate the rule gives, and who drafts when."""
from __future__ import annotations

import numpy as np
import pytest

from services.engine.sampling import Sampler, SamplingParams
from services.engine.speculation import SpeculationConfig, Speculator, verify

VOCAB = 6


def toy_logits(history: list[int]) -> np.ndarray:
    """A deterministic 'model': next-token logits from the last two tokens."""
    rng = np.random.default_rng(1000 + 31 * (history[-1] if history else 0) + (history[-2] if len(history) > 1 else 0))
    return rng.normal(0, 1.5, VOCAB).astype(np.float32)


def decode_one_by_one(sampler: Sampler, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        token, _ = sampler.pick(toy_logits(seq), seq, len(prompt), frozenset())
        seq.append(token)
    return seq[len(prompt):]


def decode_speculating(sampler: Sampler, prompt: list[int], n: int, draft_of) -> list[int]:
    seq = list(prompt)
    while len(seq) - len(prompt) < n:
        drafts = draft_of(seq)[: n - (len(seq) - len(prompt)) - 1]
        rows_context = [seq + drafts[:i] for i in range(len(drafts) + 1)]  # what row i's logits saw
        picked: list[int] = []

        def pick(i: int) -> int:
            assert rows_context[i] == seq + picked  # row i is only read while the drafts before it held
            token, _ = sampler.pick(toy_logits(rows_context[i]), seq + picked, len(prompt), frozenset())
            picked.append(token)
            return token

        seq += verify(drafts, pick, stops=lambda t: False)
    return seq[len(prompt):]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=7),
                                    SamplingParams(temperature=0.7, top_p=0.9, seed=11)])
def test_verification_emits_what_one_by_one_decoding_emits(params):
    prompt = [1, 2, 3]
    plain = decode_one_by_one(Sampler(params), prompt, 40)
    for draft_of in (lambda s: [s[-1], s[-2], 0, 1],  # mostly wrong
                     lambda s: decode_one_by_one(Sampler(params), s, 3)):  # an oracle: right when greedy
        assert decode_speculating(Sampler(params), prompt, 40, draft_of) == plain


def test_the_emitted_token_follows_the_target_and_a_draft_is_accepted_with_its_probability():
    logits = toy_logits([4, 5])
    p = np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum()
    draft = int(np.argsort(p)[-2])  # the second most likely token: accepted often, not always
    trials, counts, accepted = 4000, np.zeros(VOCAB), 0
    for seed in range(trials):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        out = verify([draft], lambda i: sampler.pick(logits, [4, 5], 2, frozenset())[0], lambda t: False)
        counts[out[0]] += 1
        accepted += out[0] == draft
    expected = p * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001
    assert abs(accepted / trials - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / trials)
    # on a rejection the token is drawn from the target with the draft removed and renormalised
    rest = np.delete(p, draft) / (1 - p[draft])
    seen = np.delete(counts, draft) / (trials - accepted)
    assert np.abs(seen - rest).max() < 0.05


def test_a_stop_token_ends_the_verified_run_there():
    assert verify([7, 8, 9], lambda i: [7, 8, 9, 10][i], lambda t: t == 8) == [7, 8]
    assert verify([7, 8, 9], lambda i: [7, 8, 9, 10][i], lambda t: False) == [7, 8, 9, 10]
    assert verify([7, 8, 9], lambda i: [7, 3, 9, 10][i], lambda t: False) == [7, 3]
    assert verify([], lambda i: 5, lambda t: False) == [5]


def test_who_drafts_when():
    spec = Speculator(SpeculationConfig(k=3, max_batch=2))
    repeated = [1, 2, 3, 4, 1, 2]
    assert spec.drafts(1, repeated, room=10, n_decoding=1) == [3, 4, 1]
    assert spec.drafts(1, repeated, room=2, n_decoding=1) == [3, 4]  # what is left of max_tokens
    assert spec.drafts(1, repeated, room=10, n_decoding=3) == []  # a batch too large to pay
    assert spec.drafts(1, repeated, room=10, n_decoding=1, wanted=False) == []  # the request said no
    assert spec.drafts(1, repeated + [3], room=10, n_decoding=1) == [4, 1, 2]  # follows the new token
    assert spec.drafts(1, [9, 9, 8], room=10, n_decoding=1) == []  # cut back (recomputed): indexed afresh
    assert Speculator(SpeculationConfig(k=0)).drafts(1, repeated, room=10, n_decoding=1) == []
    spec.observe(1, 3, 0), spec.observe(1, 3, 0)  # rejected twice: it backs off
    assert spec.drafts(1, repeated, room=10, n_decoding=1) == []
    spec.forget(1)
    assert spec.drafts(1, repeated, room=10, n_decoding=1) == [3, 4, 1]


def test_beyond_max_batch_only_a_match_of_n_max_tokens_drafts_and_none_beyond_max_batch_long():
    """In a larger batch a draft's rows cost every row's step, so only a long match's drafts (mostly
    accepted) are proposed there: a 2-token match drafts alone but not among 3 sequences; an 8-token one
    drafts among up to 8, not 9."""
    spec = Speculator(SpeculationConfig(k=3, n_min=2, n_max=8, max_batch=2, max_batch_long=8))
    short = [1, 2, 3, 4, 1, 2]  # "1 2" occurred before: a 2-token match
    assert spec.drafts(1, short, room=10, n_decoding=2) == [3, 4, 1]
    assert spec.drafts(1, short, room=10, n_decoding=3) == []
    line = list(range(10, 18))
    long = line + [99, 98, 97] + line  # the whole 8-token line occurred before
    assert spec.drafts(2, long, room=10, n_decoding=3) == [99, 98, 97]
    assert spec.drafts(2, long, room=10, n_decoding=8) == [99, 98, 97]
    assert spec.drafts(2, long, room=10, n_decoding=9) == []
    assert SpeculationConfig(max_batch=2, max_batch_long=8).batch_limit == 8

