"""The engine contract (BatchEngine, services/engine/api.py), checked the same way on every engine.

Each test runs on the torch engine (prefill_gpu) and the OpenCL engine (decode_fpga), requests
going through an engine loop of their own over the engine's paged step (services/engine/one_request.py):
greedy tokens equal to transformers', batching that changes nothing, seeded sampling,
finish reasons, the context window, and KV imported from another engine. A check
that only one engine can answer (its own logits, its device layout) stays with it.
"""
from __future__ import annotations

import functools

import pytest

from services.engine.one_request import OneRequest, greedy_tokens, local_loop
from services.engine.sampling import SamplingParams
from services.errors import PromptTooLong
from tests.conftest import hf_greedy, random_prompt
from tests.engine.local_handoff import decode_imported, prefilled_kv

ENGINES = ["torch_engine", "ocl_engine"]


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference(hf_model):
    """transformers' greedy tokens, computed once per prompt for every engine."""
    @functools.lru_cache(maxsize=None)
    def greedy_of(prompt: tuple[int, ...], n_new: int) -> tuple[int, ...]:
        return tuple(hf_greedy(hf_model, list(prompt), n_new))
    return greedy_of


def greedy(engine, prompt, n, max_context=1024):
    return greedy_tokens(engine, prompt, n, max_context)


@pytest.mark.slow
@pytest.mark.parametrize("n_prompt,n_new,seed", [(1, 64, 11), (5, 64, 1), (17, 16, 11), (128, 16, 11),
                                                 (300, 64, 1), (512, 64, 11)])
def test_greedy_identical_to_transformers(engine, reference, model_config, n_prompt, n_new, seed):
    prompt = random_prompt(n_prompt, model_config.vocab_size, seed=seed)
    assert greedy(engine, prompt, n_new) == list(reference(tuple(prompt), n_new))


def test_chat_prompt_greedy_identical_to_transformers(engine, reference, tokenizer):
    from services.model.tokenizer import chat_prompt_ids

    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    assert greedy(engine, prompt, 24) == list(reference(tuple(prompt), 24))


def test_batch_of_three_lengths_equals_each_alone(engine, model_config):
    prompts = [random_prompt(n, model_config.vocab_size, seed=2) for n in (3, 40, 11)]
    alone = [greedy(engine, p, 8) for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with local_loop(engine, 1024) as loop:  # all three in the loop at once: they share its steps
        streams = [loop.submit(p, params) for p in prompts]
        batched = [[ev.token for ev in s] for s in streams]
        steps = loop.steps
    assert batched == alone
    assert steps < 3 * 8  # (they did share steps: alone, they take 8 each)


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine, model_config):
    prompt = random_prompt(12, model_config.vocab_size, seed=3)

    def run(seed):
        p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
        return [ev.token for ev in OneRequest(engine, prompt, p, 1024)]

    first = run(7)
    assert run(7) == first
    assert run(8) != first


def test_finish_reasons_stop_and_length(engine, model_config):
    prompt = random_prompt(6, model_config.vocab_size, seed=4)
    expected = greedy(engine, prompt, 5)
    events = list(OneRequest(engine, prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), 1024))
    assert [e.finish_reason for e in events] == [None] * 4 + ["length"]
    # a stop token id ends the stream on that token, with finish_reason "stop"
    stop_at = expected[2]
    params = SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(stop_at,), ignore_eos=True)
    events = list(OneRequest(engine, prompt, params, 1024))
    assert events[-1].token == stop_at and events[-1].finish_reason == "stop"
    assert len(events) == expected.index(stop_at) + 1


def test_context_window_limits(engine, model_config):
    with pytest.raises(PromptTooLong):
        OneRequest(engine, [5] * 10, SamplingParams(max_tokens=1), max_context=10)
    # generation stops with "length" when the context fills before max_tokens
    events = list(OneRequest(engine, [5] * 8, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), 12))
    assert len(events) == 4 and events[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="out of the vocabulary"):
        OneRequest(engine, [model_config.vocab_size], SamplingParams(), 1024)


def test_kv_imported_from_torch_decodes_like_torch(engine, torch_engine, model_config):
    """The hybrid hand-off's receiving side: torch prefills, `engine` imports the wire-layout KV into the
    blocks its loop reserved and decodes on from torch's first token."""
    prompt = random_prompt(21, model_config.vocab_size, seed=17)
    first, kv = prefilled_kv(torch_engine, prompt)
    assert decode_imported(engine, prompt, first, kv, 8) == greedy(torch_engine, prompt, 9)
