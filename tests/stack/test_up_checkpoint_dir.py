"""`HYBRIDSERVE_MODEL=<a Hugging Face directory> hybridserve up`, as a new user brings a Qwen model:
a tiny Qwen2 (q/k/v biases) saved by transformers at test time with the default tokenizer and a
Qwen2.5-style chat template that defines tools beside it. The whole stack serves it: /v1/models names
the directory, a chat request gives the same greedy text in gpu, fpga and hybrid mode, transformers'
own greedy continuation of the templated prompt, and a chat request with `tools` and tool_choice
`required` or a named function answers one call of an offered function, its arguments valid for the
function's schema, finish_reason `tool_calls`, the same call in every mode (the grammar applied by
whichever engine samples: a random tiny model writes no call without it).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import pytest

from harness.stack import start_stack
from services.decode_fpga.settings import DecodeSettings
from services.prefill_gpu.settings import PrefillSettings
from tests.conftest import hf_greedy
from tests.gateway.test_tools import ADD, TOOLS_TEMPLATE, WEATHER
from tests.model.tiny_checkpoints import save_checkpoint, tiny_model
from tests.stack.test_up_heals import http_json

MESSAGES = [{"role": "user", "content": "Name a colour."}]
N_NEW = 8
MODES = ("gpu", "fpga", "hybrid")


def with_template(path, template: str):
    """The checkpoint directory's chat template replaced by `template` (in tokenizer_config.json)."""
    (path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def post_json(url: str, body: dict) -> tuple[int, dict]:
    """(status, the JSON answer), the error's body too."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def tool_calls_in_every_mode(url: str, tool_choice) -> dict[str, tuple[str, dict]]:
    """Per mode, the one call a tools request answers: (function name, arguments), each checked."""
    functions = {t["function"]["name"]: t["function"] for t in (WEATHER, ADD)}
    calls = {}
    for mode in MODES:
        status, reply = post_json(url + "/v1/chat/completions", {
            "model": "tiny-qwen2", "messages": [{"role": "user", "content": "What is 2 plus 3?"}],
            "tools": [WEATHER, ADD], "tool_choice": tool_choice, "max_tokens": 70, "temperature": 0, "mode": mode})
        assert status == 200, reply
        choice = reply["choices"][0]
        assert reply["hybridserve"]["mode"] == mode and choice["finish_reason"] == "tool_calls", (mode, choice)
        (call,) = choice["message"]["tool_calls"]  # the output is the call alone: no content left
        assert choice["message"]["content"] is None, choice
        assert call["type"] == "function" and call["id"].startswith("call_")
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, functions[name]["parameters"])
        calls[mode] = (name, arguments)
    return calls


@pytest.mark.slow
def test_up_serves_a_qwen2_directory_with_its_template_in_every_mode(tmp_path, tokenizer, profile_cache):
    from transformers import AutoTokenizer

    model = tiny_model("qwen2", seed=5)
    path = with_template(save_checkpoint(model, tokenizer, tmp_path / "tiny-qwen2"), TOOLS_TEMPLATE)
    own = AutoTokenizer.from_pretrained(path)
    ids = own.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 answers a BatchEncoding
    assert own.decode(ids).startswith("<|im_start|>user\n")  # the directory's template, not the default's
    expected = own.decode(hf_greedy(model, list(ids), N_NEW), skip_special_tokens=True)
    env = {"HYBRIDSERVE_MODEL": str(path), "HYBRIDSERVE_PROFILE_AT_START": "false",
           "HYBRIDSERVE_PROFILE_CACHE": str(profile_cache),
           PrefillSettings.env_name("arena_bytes"): str(16 << 20),
           PrefillSettings.env_name("kv_cache_mb"): "16", DecodeSettings.env_name("kv_cache_mb"): "16",
           DecodeSettings.env_name("max_context"): "256"}
    stack = start_stack(tmp_path / "up.log", env, timeout=600)
    try:
        models = http_json(stack.url + "/v1/models")[2]["data"]
        assert [m["id"] for m in models] == ["tiny-qwen2"], models
        texts = {}
        for mode in MODES:
            status, _, reply = http_json(stack.url + "/v1/chat/completions", {
                "model": "tiny-qwen2", "messages": MESSAGES, "max_tokens": N_NEW, "temperature": 0,
                "ignore_eos": True, "mode": mode})
            assert status == 200, reply
            assert reply["hybridserve"]["mode"] == mode and reply["usage"]["completion_tokens"] == N_NEW
            assert reply["usage"]["prompt_tokens"] == len(ids)  # the checkpoint's own template applied
            texts[mode] = reply["choices"][0]["message"]["content"]
        assert texts == {"gpu": expected, "fpga": expected, "hybrid": expected}
        # tools: one call of either function (required), or of the one named; the same in every mode
        required = tool_calls_in_every_mode(stack.url, "required")
        assert len(set(map(json.dumps, required.values()))) == 1, required
        named = tool_calls_in_every_mode(stack.url, {"type": "function", "function": {"name": "add"}})
        assert named["gpu"][0] == "add" and len(set(map(json.dumps, named.values()))) == 1, named
    finally:
        stack.stop()
