"""A sequence's grammar matcher (services/engine/grammar.py) on the default model's tokenizer: the mask it
puts on a row, the tokens it accepts, where it stops, a migration's earlier output, a grammar that does
not compile. The engines and modes run it in tests/gateway/test_api_structured.py."""
from __future__ import annotations

import json
import re

import llguidance
import numpy as np
import pytest

from services.engine.grammar import GrammarTokenizer, prepare_masks
from services.engine.sampling import Sampler, SamplingParams
from services.errors import InvalidRequest
from services.gateway.protocol.structured import grammar_of


@pytest.fixture(scope="module")
def grammars(tokenizer, model_config):
    return GrammarTokenizer(lambda: tokenizer, model_config.vocab_size, model_config.eos_token_ids)


def test_the_mask_leaves_only_what_the_grammar_allows_and_the_grammar_ends_the_sequence(grammars, tokenizer):
    m = grammars.matcher(grammar_of("regex", regex="[0-9]{2}"))
    logits = np.zeros(grammars.vocab_size, np.float32)
    masked = m.apply(logits)
    allowed = np.flatnonzero(np.isfinite(masked))
    assert allowed.size and all(tokenizer.decode([t]).isdigit() for t in allowed)
    assert logits.min() == 0  # the engine's row is left alone
    sampler = Sampler(SamplingParams(temperature=0, grammar="x"), grammar=m)
    first, _ = sampler.pick(logits, [1], 1, frozenset())  # a flat row: the lowest allowed id
    assert first == allowed[0] and not m.stopped
    prepare_masks([m]).result()
    second, _ = sampler.pick(logits, [1, first], 1, frozenset())
    assert (tokenizer.decode([first, second])).isdigit() and len(tokenizer.decode([first, second])) == 2
    assert m.stopped  # two digits and nothing can follow: the sequence ends on this token


def test_a_continuation_starts_past_the_output_so_far(grammars, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    so_far = tokenizer('{"a":', add_special_tokens=False).input_ids
    m = grammars.matcher(grammar_of("json_schema", schema), prior_tokens=so_far)
    allowed = np.flatnonzero(m.allowed())
    # a number, or the bounded whitespace JSON allows before it
    assert allowed.size and all(re.fullmatch(r"[ \n\t]*(-?[0-9]+|-)?", tokenizer.decode([t])) for t in allowed)
    with pytest.raises(InvalidRequest, match="does not fit"):
        grammars.matcher(grammar_of("json_schema", schema), prior_tokens=tokenizer("hello").input_ids)


def _accepts(grammars, grammar: str, text: str) -> bool:
    """Whether the grammar's matcher takes `text`, fed byte by byte, to a complete match."""
    tok = grammars.get()
    m = llguidance.LLMatcher(tok, grammar)
    for ch in text.encode():
        ids = tok.tokenize_bytes(bytes([ch]))
        if len(ids) != 1 or not m.consume_token(ids[0]):
            return False
    return m.is_accepting()


def test_json_takes_bounded_whitespace_by_default_and_compact_json_on_request(grammars):
    any_object = grammar_of("json_object")
    assert _accepts(grammars, any_object, '{"a":1}')
    assert _accepts(grammars, any_object, '{\n    "name": "Mara",\n\t"x": [1, 2]\n}')
    assert not _accepts(grammars, any_object, '{  "a":1}')  # two spaces
    assert not _accepts(grammars, any_object, '{\n\n"a":1}')  # two newlines
    assert not _accepts(grammars, any_object, "{\n" + " " * 21 + '"a":1}')  # an indent past 20
    compact = grammar_of("json_schema", {"type": "object", "x-guidance": {"whitespace_flexible": False}})
    assert _accepts(grammars, compact, '{"a":1}') and not _accepts(grammars, compact, '{"a": 1}')


def test_a_grammar_that_does_not_compile_is_an_invalid_request(grammars):
    with pytest.raises(InvalidRequest, match="does not compile"):
        grammars.matcher("start: nowhere")


def test_a_migrated_request_goes_on_under_its_grammar_as_if_uninterrupted(grammars, torch_engine, model_config,
                                                                          tokenizer):
    # the gateway's continuation: prompt + the tokens out so far, prior_output_tokens saying how many
    from services.engine.engine_loop import EngineLoop
    from services.engine.scheduler import SchedulerConfig

    config = SchedulerConfig(num_blocks=torch_engine.num_blocks, block_size=torch_engine.block_size, max_num_seqs=2,
                             max_num_batched_tokens=torch_engine.max_num_batched_tokens, max_model_len=1024)
    loop = EngineLoop(torch_engine, config, model_config.eos_token_ids, grammars=grammars)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
    params = SamplingParams(max_tokens=30, temperature=0, grammar=grammar_of("json_schema", schema))
    prompt = tokenizer("A person as JSON:").input_ids
    try:
        whole = [e.token for e in loop.submit(prompt, params)]
        cut = 4
        events = list(loop.submit(prompt + whole[:cut], SamplingParams(
            max_tokens=30 - cut, temperature=0, grammar=params.grammar, prior_output_tokens=cut)))
    finally:
        loop.close()
    assert [e.token for e in events] == whole[cut:] and events[-1].finish_reason == "stop"
    assert isinstance(json.loads(tokenizer.decode(whole)), dict)
