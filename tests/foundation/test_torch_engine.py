"""The PyTorch engine against transformers: logits, greedy tokens, batching, sampling."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.generation import Generation, PromptTooLong
from services.engine.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompt

ATOL = 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 17, 128, 512])
def test_logits_match_transformers_at_prefill_and_16_decode_steps(torch_engine, hf_model, model_config, n):
    prompt = random_prompt(n, model_config.vocab_size)
    seq = torch_engine.new_sequence(n + 16)
    ours = torch_engine.prefill(seq, prompt)
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
    np.testing.assert_allclose(ours, out.logits[0, -1].numpy(), atol=ATOL, rtol=0)
    past = out.past_key_values
    for _ in range(16):
        token = int(np.argmax(ours))
        ours = torch_engine.decode([seq], [token])[0]
        with torch.no_grad():
            out = hf_model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        np.testing.assert_allclose(ours, out.logits[0, -1].numpy(), atol=ATOL, rtol=0)


def _greedy(engine, prompt, n, max_context=8192):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [ev.token for ev in Generation(engine, prompt, params, max_context)]


@pytest.mark.slow
@pytest.mark.parametrize("n", [5, 300])
def test_greedy_64_tokens_identical_to_transformers_generate(torch_engine, hf_model, model_config, n):
    prompt = random_prompt(n, model_config.vocab_size, seed=1)
    assert _greedy(torch_engine, prompt, 64) == hf_greedy(hf_model, prompt, 64)


def test_chat_prompt_greedy_identical_to_transformers(torch_engine, hf_model, tokenizer):
    from services.model.tokenizer import chat_prompt_ids

    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    assert _greedy(torch_engine, prompt, 24) == hf_greedy(hf_model, prompt, 24)


def test_batch_of_three_lengths_equals_each_alone(torch_engine, model_config):
    prompts = [random_prompt(n, model_config.vocab_size, seed=2) for n in (3, 40, 11)]
    alone = [_greedy(torch_engine, p, 8) for p in prompts]
    seqs = [torch_engine.new_sequence(len(p) + 8) for p in prompts]
    tokens = [int(np.argmax(torch_engine.prefill(s, p))) for s, p in zip(seqs, prompts)]
    batched = [[t] for t in tokens]
    for _ in range(7):
        tokens = torch_engine.decode_greedy(seqs, tokens)
        for out, t in zip(batched, tokens):
            out.append(t)
    assert batched == alone


def test_seeded_sampling_is_reproducible_and_seed_dependent(torch_engine, model_config):
    prompt = random_prompt(12, model_config.vocab_size, seed=3)

    def run(seed):
        p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
        return [ev.token for ev in Generation(torch_engine, prompt, p, 8192)]

    first = run(7)
    assert run(7) == first
    assert run(8) != first


def test_finish_reasons_stop_and_length(torch_engine, model_config):
    prompt = random_prompt(6, model_config.vocab_size, seed=4)
    expected = _greedy(torch_engine, prompt, 5)
    events = list(Generation(torch_engine, prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), 8192))
    assert [e.finish_reason for e in events] == [None] * 4 + ["length"]
    # a stop token id ends the stream on that token, with finish_reason "stop"
    stop_at = expected[2]
    params = SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(stop_at,), ignore_eos=True)
    events = list(Generation(torch_engine, prompt, params, 8192))
    assert events[-1].token == stop_at and events[-1].finish_reason == "stop"
    assert len(events) == expected.index(stop_at) + 1


def test_context_window_limits(torch_engine, model_config):
    with pytest.raises(PromptTooLong):
        Generation(torch_engine, [5] * 10, SamplingParams(max_tokens=1), max_context=10)
    # generation stops with "length" when the context fills before max_tokens
    events = list(Generation(torch_engine, [5] * 8, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), 12))
    assert len(events) == 4 and events[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="out of the vocabulary"):
        Generation(torch_engine, [model_config.vocab_size], SamplingParams(), 8192)
