"""Continuations on the real torch engine through the engine loop: what the gateway re-submits after a
migration (prompt + the tokens out so far) gives the uninterrupted run's tokens: seeded sampling because
each token's randomness is keyed by the seed and its position, penalties because the call says how many
of its prompt's tokens are output already."""
from __future__ import annotations

import pytest

from services.engine.engine_loop import EngineLoop
from services.engine.sampling import SamplingParams
from services.engine.scheduler import SchedulerConfig


@pytest.fixture(scope="module")
def loop(torch_engine, model_config):
    e = torch_engine
    loop = EngineLoop(e, SchedulerConfig(num_blocks=e.num_blocks, block_size=e.block_size, max_num_seqs=4,
                                         max_num_batched_tokens=e.max_num_batched_tokens, max_model_len=512),
                      model_config.eos_token_ids)
    yield loop
    loop.close()


def test_a_seeded_continuation_samples_what_the_uninterrupted_run_did(loop):
    prompt = [504, 3575, 282, 4649, 314]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=77, ignore_eos=True)
    whole = [ev.token for ev in loop.submit(prompt, params)]
    rest = [ev.token for ev in loop.submit(prompt + whole[:3], SamplingParams(
        max_tokens=5, temperature=1.0, seed=77, ignore_eos=True))]
    assert rest == whole[3:]
    other = [ev.token for ev in loop.submit(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=78,
                                                                    ignore_eos=True))]
    assert other != whole


def test_a_penalized_continuation_counts_the_earlier_output_as_output(loop):
    prompt = [504, 3575, 282, 4649, 314]
    third = [ev.token for ev in loop.submit(prompt, SamplingParams(max_tokens=3, temperature=0.0,
                                                                    ignore_eos=True))][2]
    # the greedy third token ends the request, allowed from the third token on (min_tokens 2)
    controls = {"temperature": 0.0, "ignore_eos": True, "presence_penalty": 0.5, "min_tokens": 2,
                "stop_token_ids": (third,)}
    whole = [ev.token for ev in loop.submit(prompt, SamplingParams(max_tokens=8, **controls))]
    assert whole[-1] == third and len(whole) == 3
    # after a migration two tokens in: its two prompt tokens count toward min_tokens, so the stop may come
    rest = [ev.token for ev in loop.submit(prompt + whole[:2], SamplingParams(
        max_tokens=6, prior_output_tokens=2, **controls))]
    assert rest == whole[2:]


def test_a_continued_choice_draws_its_own_choices_random_stream(loop):
    # choice 2 of an n > 1 request, migrated: an n = 1 call whose first_choice says which choice it continues
    prompt = [504, 3575, 282, 4649, 314]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=9, ignore_eos=True)
    whole = [ev.token for ev in loop.submit(prompt, params, choice=2)]
    rest = [ev.token for ev in loop.submit(prompt + whole[:2], SamplingParams(
        max_tokens=4, temperature=1.0, seed=9, ignore_eos=True, first_choice=2))]
    assert rest == whole[2:]
    assert [ev.token for ev in loop.submit(prompt + whole[:2], SamplingParams(
        max_tokens=4, temperature=1.0, seed=9, ignore_eos=True))] != whole[2:]  # choice 0's stream
