"""`HYBRIDSERVE_MODEL=<a Hugging Face directory> hybridserve up`, as a new user brings a Qwen model:
a tiny Qwen2 (q/k/v biases) saved by transformers at test time with the default tokenizer and its
chat template beside it. The whole stack serves it: /v1/models names the directory, and a chat request
gives the same greedy text in gpu, fpga and hybrid mode, transformers' own greedy continuation of the
templated prompt.
"""
from __future__ import annotations

import pytest

from harness.stack import start_stack
from services.decode_fpga.settings import DecodeSettings
from services.prefill_gpu.settings import PrefillSettings
from tests.conftest import hf_greedy
from tests.model.tiny_checkpoints import save_checkpoint, tiny_model
from tests.stack.test_up_heals import http_json

MESSAGES = [{"role": "user", "content": "Name a colour."}]
N_NEW = 8


@pytest.mark.slow
def test_up_serves_a_qwen2_directory_with_its_template_in_every_mode(tmp_path, tokenizer, profile_cache):
    model = tiny_model("qwen2", seed=5)
    path = save_checkpoint(model, tokenizer, tmp_path / "tiny-qwen2")
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 answers a BatchEncoding
    expected = tokenizer.decode(hf_greedy(model, list(ids), N_NEW), skip_special_tokens=True)
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
        for mode in ("gpu", "fpga", "hybrid"):
            status, _, reply = http_json(stack.url + "/v1/chat/completions", {
                "model": "tiny-qwen2", "messages": MESSAGES, "max_tokens": N_NEW, "temperature": 0,
                "ignore_eos": True, "mode": mode})
            assert status == 200, reply
            assert reply["hybridserve"]["mode"] == mode and reply["usage"]["completion_tokens"] == N_NEW
            assert reply["usage"]["prompt_tokens"] == len(ids)  # the checkpoint's own template applied
            texts[mode] = reply["choices"][0]["message"]["content"]
        assert texts == {"gpu": expected, "fpga": expected, "hybrid": expected}
    finally:
        stack.stop()
