"""Tool calls (services/gateway/protocol/tools.py): the tools rendered by a chat template that defines them, the
model's Hermes/Qwen `<tool_call>` blocks parsed into `tool_calls`, and tool_choice required / a named
function enforced by the grammar on the real model through an engine loop. In process; the 400s for a
template without tools and a tool_choice naming no tool are in test_edge.py."""
from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from services.engine.engine_loop import EngineLoop
from services.engine.grammar import GrammarTokenizer
from services.engine.sampling import SamplingParams
from services.engine.scheduler import SchedulerConfig
from services.gateway.protocol.tools import call_grammar, parse_tool_calls, template_takes_tools
from services.model.tokenizer import chat_prompt_ids
from tests.gateway.test_checkpoint_tokenizer import tokenizer_dir

# the tool part of a Qwen2.5-style template: the tools as JSON in the system turn
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
                  "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "a city's weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}


def test_a_template_that_defines_tools_shows_them_and_the_gateway_takes_them(tmp_path, tokenizer):
    from services.gateway.api.app import create_app
    from services.gateway.settings import GatewaySettings
    from services.model.checkpoint import locate
    from services.model.tokenizer import load_tokenizer

    path = tokenizer_dir(tmp_path / "qwen2-tools", tokenizer, "qwen2", TOOLS_TEMPLATE)
    tok = load_tokenizer(locate(path))
    assert template_takes_tools(tok) and not template_takes_tools(tokenizer)
    text = tok.decode(chat_prompt_ids(tok, [{"role": "user", "content": "Weather in Paris?"}], [WEATHER]))
    assert '"name": "get_weather"' in text and text.endswith("<|im_start|>assistant\n")
    # engines at a port nothing listens on: a request the gateway takes gets as far as the dispatcher
    settings = GatewaySettings(model=str(path), prefill_address="127.0.0.1:1", decode_address="127.0.0.1:1")
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/chat/completions", json={"model": "qwen2-tools", "tools": [WEATHER],
                                                      "tool_choice": "required",
                                                      "messages": [{"role": "user", "content": "Weather?"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        bad = {**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "strin"}}}
        r = client.post("/v1/chat/completions", json={"model": "qwen2-tools", "tools": [bad], "tool_choice": "required",
                                                      "messages": [{"role": "user", "content": "Weather?"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_tool_call_blocks_become_tool_calls_and_the_rest_stays_content():
    text = 'Let me see.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(text, {"add"})
    assert content == "Let me see." and len(calls) == 1
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert calls[0]["id"].startswith("call_")
    # a block naming a function not offered, or broken JSON, is text
    assert parse_tool_calls(text, {"sub"}) == (text, [])
    assert parse_tool_calls("<tool_call>{oops</tool_call>", {"add"}) == ("<tool_call>{oops</tool_call>", [])


@pytest.mark.parametrize("name", [None, "add"])
def test_tool_choice_required_or_named_makes_the_real_models_output_one_valid_call(torch_engine, loaded_model,
                                                                                   tokenizer, name):
    cfg = loaded_model.config
    grammars = GrammarTokenizer(lambda: tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    config = SchedulerConfig(num_blocks=torch_engine.num_blocks, block_size=torch_engine.block_size, max_num_seqs=2,
                             max_num_batched_tokens=torch_engine.max_num_batched_tokens, max_model_len=1024)
    loop = EngineLoop(torch_engine, config, cfg.eos_token_ids, grammars=grammars)
    try:
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is 2 plus 3?"}])
        grammar = call_grammar([WEATHER["function"], ADD["function"]], name)
        events = list(loop.submit(prompt, SamplingParams(max_tokens=60, temperature=0, grammar=grammar)))
    finally:
        loop.close()
    text = tokenizer.decode([e.token for e in events])
    content, calls = parse_tool_calls(text, {"get_weather", "add"})
    assert events[-1].finish_reason == "stop" and content is None and len(calls) == 1, text
    fn = calls[0]["function"]
    assert name is None or fn["name"] == name
    params = {"get_weather": WEATHER, "add": ADD}[fn["name"]]["function"]["parameters"]
    jsonschema.validate(json.loads(fn["arguments"]), params)
