"""Speculative decoding on both real engines through the engine loop (n-gram drafts verified in one step):
greedy and seeded tokens identical with speculation on and off, alone and in a batch, under a grammar, the
drafts really accepted (fewer steps), and every block back in the pool at the end."""
from __future__ import annotations

import threading

import pytest

from services.engine import metrics as m
from services.engine.engine_loop import EngineLoop
from services.engine.grammar import GrammarTokenizer
from services.engine.sampling import SamplingParams
from services.engine.scheduler import SchedulerConfig
from services.engine.speculation import SpeculationConfig
from services.gateway.protocol.structured import grammar_of

# a text that repeats: the model's greedy continuation copies it, which is what n-gram drafts guess
TEXT = ("The river runs past the old mill, under the stone bridge and into the valley where the farmers "
        "keep their sheep. ")


def copy_prompt(tokenizer, times: int = 3) -> list[int]:
    return tokenizer((TEXT * times) + "The river", add_special_tokens=False).input_ids


def run(engine, eos, prompts_params, k: int, grammars=None) -> tuple[list[list[int]], int, int]:
    """Each (prompt, params) through a fresh loop at once; (their tokens, the loop's steps, blocks leaked)."""
    config = SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size, max_num_seqs=4,
                             max_num_batched_tokens=min(128, engine.max_num_batched_tokens), max_model_len=1024,
                             speculation=SpeculationConfig(k=k, n_min=2, n_max=4, max_batch=4))
    loop = EngineLoop(engine, config, eos, grammars=grammars)
    try:
        streams = [loop.submit(p, params) for p, params in prompts_params]
        outs: list[list[int]] = [[] for _ in streams]
        readers = [threading.Thread(target=lambda s=s, o=o: o.extend(ev.token for ev in s))
                   for s, o in zip(streams, outs)]
        for r in readers:
            r.start()
        for r in readers:
            r.join(300)
        bm = loop.scheduler.block_manager
        leaked = config.num_blocks - bm.num_free_blocks
        return outs, loop.steps, leaked
    finally:
        loop.close()


@pytest.fixture(params=["torch", "opencl"])
def engine(request, torch_engine, ocl_gguf_engine):
    return {"torch": torch_engine, "opencl": ocl_gguf_engine}[request.param]


def test_greedy_tokens_are_the_same_with_drafts_and_the_drafts_are_taken(engine, tokenizer, model_config):
    eos = model_config.eos_token_ids
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    prompt = copy_prompt(tokenizer)
    (off,), steps_off, _ = run(engine, eos, [(prompt, greedy)], k=0)
    accepted = m.SPEC_ACCEPTED_TOKENS._value.get()
    (on,), steps_on, leaked = run(engine, eos, [(prompt, greedy)], k=4)
    assert on == off
    assert m.SPEC_ACCEPTED_TOKENS._value.get() > accepted  # drafts were accepted, not only proposed
    assert steps_on < steps_off  # and the output took fewer steps
    assert leaked == 0


def test_a_batch_with_drafts_gives_each_row_its_own_run_seeded_too(engine, tokenizer, model_config):
    eos = model_config.eos_token_ids
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    work = [(copy_prompt(tokenizer), greedy), (copy_prompt(tokenizer, 2), seeded),
            (tokenizer("Write a short poem about tea.", add_special_tokens=False).input_ids, greedy)]
    alone = [run(engine, eos, [w], k=0)[0][0] for w in work]
    together, _, leaked = run(engine, eos, work, k=4)
    assert together == alone
    assert leaked == 0


def test_a_grammar_with_drafts_gives_the_tokens_it_gives_without(torch_engine, tokenizer, model_config):
    grammars = GrammarTokenizer(lambda: tokenizer, model_config.vocab_size, model_config.eos_token_ids)
    text = '{"city": "Paris", "river": "Seine"}\n' * 3 + '{"city": "'
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    # the rest of the line the prompt repeats: drafts copy it, and every one must pass the grammar too
    grammar = grammar_of("regex", regex=r'[A-Za-z]+", "river": "[A-Za-z]+"\}')
    params = SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar)
    eos = model_config.eos_token_ids
    (off,), _, _ = run(torch_engine, eos, [(prompt, params)], k=0, grammars=grammars)
    (on,), _, leaked = run(torch_engine, eos, [(prompt, params)], k=4, grammars=grammars)
    assert on == off and tokenizer.decode(on).endswith("}")
    assert leaked == 0
