"""Model location, config and weight loading: the default GGUF, an HF safetensors
directory, and the clear errors for everything we refuse."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.model.checkpoint import CheckpointError, locate
from services.model.config import read_config
from services.model.loading import load_model
from tests.engine.step_calls import prompt_logits


def test_default_checkpoint_is_smollm2(model_config):
    c = model_config
    assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.eos_token_ids == (2,)


def test_gguf_weights_equal_transformers(loaded_model, hf_model):
    sd = hf_model.state_dict()
    w = loaded_model.weights
    for i in (0, 29):
        layer = w.layers[i]
        pre = f"model.layers.{i}."
        np.testing.assert_array_equal(layer.wq, sd[pre + "self_attn.q_proj.weight"].numpy())
        np.testing.assert_array_equal(layer.wk, sd[pre + "self_attn.k_proj.weight"].numpy())
        np.testing.assert_array_equal(layer.w_down, sd[pre + "mlp.down_proj.weight"].numpy())
    np.testing.assert_array_equal(w.embed, sd["model.embed_tokens.weight"].numpy())


def test_missing_path_is_clear(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        locate(tmp_path / "nope.gguf")


def test_corrupt_gguf_is_refused(tmp_path, loaded_model):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(loaded_model.checkpoint.path.read_bytes()[:4096])
    with pytest.raises(CheckpointError, match="truncated.gguf"):
        load_model(str(bad))


def test_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\x80\x04not a gguf")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        locate(f)


def test_directory_without_config_is_refused(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="without config.json.*weights.safetensors"):
        locate(tmp_path)


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    with pytest.raises(CheckpointError, match="model_type 'falcon' is not supported"):
        read_config(locate(tmp_path))


def _tiny_llama_dir(tmp_path, safe: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, rope_theta=5000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path, safe_serialization=safe)
    return model


def test_pickled_hf_checkpoint_is_never_loaded(tmp_path):
    _tiny_llama_dir(tmp_path, safe=True)
    for f in tmp_path.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))  # what a pickle-only checkpoint looks like
    with pytest.raises(CheckpointError, match="pickled checkpoints"):
        load_model(str(tmp_path))


def test_hf_directory_untied_head_matches_transformers(tmp_path):
    from services.prefill_gpu.engine import TorchEngine

    ref = _tiny_llama_dir(tmp_path, safe=True)
    loaded = load_model(str(tmp_path))
    assert not loaded.config.tie_embeddings and loaded.config.rope_theta == 5000.0
    engine = TorchEngine(loaded.config, loaded.weights, device="cpu")
    ids = [5, 17, 99, 3, 42, 7]
    ours = prompt_logits(engine, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0, -1].numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
