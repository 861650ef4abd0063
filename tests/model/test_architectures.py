"""The architecture descriptions (services/model/architecture.py) and what the config loader makes of a
checkpoint's architecture: refusals that name what is served, RoPE frequencies equal to
transformers' for every scaling served, a sliding window that would matter capped."""
from __future__ import annotations

import json

import numpy as np
import pytest

from services.model.architecture import ARCHITECTURES, GGUF_SUPPORTED, SUPPORTED, RopeScaling, rope_inv_freq
from services.model.checkpoint import CheckpointError, locate
from services.model.config import read_config
from tests.model.tiny_checkpoints import family_config


def write_config(path, cfg) -> None:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_description_names_each_tensor_it_wants(arch):
    """A newcomer's entry is checked: every tensor its parts need has a name in each format it loads from."""
    a = ARCHITECTURES[arch]
    for table in [a.hf_names] + ([a.gguf_names] if a.gguf_name else []):
        for name in a.wanted():
            fused = {"wq": "wqkv", "wk": "wqkv", "wv": "wqkv", "bq": "bqkv", "bk": "bqkv", "bv": "bqkv"}.get(name)
            assert f"layers.{{i}}.{name}" in table or f"layers.{{i}}.{fused}" in table, (arch, name)
        for name in ("embed", "final_norm", "lm_head") + (("pos_embed",) if a.positions == "learned" else ()):
            assert name in table, (arch, name)


def test_unsupported_hf_architecture_is_refused_naming_what_is_served(tmp_path):
    write_config(tmp_path, {"model_type": "falcon"})
    with pytest.raises(CheckpointError, match="model_type 'falcon' is not supported") as err:
        read_config(locate(tmp_path))
    assert all(name in str(err.value) for name in SUPPORTED)


def test_unsupported_gguf_architecture_is_refused_naming_what_is_served(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="GGUF architecture 'falcon' is not supported") as err:
        read_config(locate(path))
    assert all(name in str(err.value) for name in GGUF_SUPPORTED)


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rope_frequencies_equal_transformers(tmp_path, rope):
    """Both engines take their angles from ModelConfig.inv_freq: bit for bit transformers' own."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters={**rope, "rope_theta": 500000.0})
    write_config(tmp_path, hf)
    cfg = read_config(locate(tmp_path))
    assert cfg.rope_scaling.rope_type == rope["rope_type"]
    if rope["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        want = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)[0]
    else:
        want = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")[0]
    np.testing.assert_array_equal(cfg.inv_freq(), want.numpy())


def test_llama3_scaling_changes_the_frequencies():
    plain = rope_inv_freq(10000.0, 32)
    scaled = rope_inv_freq(10000.0, 32, RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    assert scaled[0] == plain[0] and scaled[-1] == plain[-1] / np.float32(8.0)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    cfg = family_config("llama3").to_dict()
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    write_config(tmp_path, cfg)
    with pytest.raises(CheckpointError, match="rope scaling 'yarn' is not supported.*llama3"):
        read_config(locate(tmp_path))


@pytest.mark.parametrize("window,served", [(4096, 256), (64, 64), (None, 256)])
def test_a_sliding_window_that_would_matter_caps_the_context(tmp_path, window, served):
    """The engines attend to every cached position: within the window that is what a Mistral computes,
    past it it is not, so the context served stops at the window."""
    cfg = family_config("mistral").to_dict()
    cfg["sliding_window"] = window
    write_config(tmp_path, cfg)
    got = read_config(locate(tmp_path))
    assert got.arch.name == "mistral" and got.max_context == served


def test_each_family_config_is_read(tmp_path):
    for family in ("llama3", "qwen2", "mistral", "qwen3", "gpt2"):
        write_config(tmp_path / family, family_config(family))
        c = read_config(locate(tmp_path / family))
        assert (c.n_layers, c.hidden, c.n_heads, c.vocab_size) == (2, 128, 4, 49152), family
    gpt2 = read_config(locate(tmp_path / "gpt2"))
    assert gpt2.arch.norm == "layer" and gpt2.arch.positions == "learned" and gpt2.n_kv_heads == 4
    assert not gpt2.inv_freq().any()  # an identity rotation: the OpenCL kernels' RoPE changes nothing
    assert read_config(locate(tmp_path / "qwen3")).arch.qk_norm


def test_a_config_missing_a_field_is_refused_clearly(tmp_path):
    write_config(tmp_path, {"model_type": "gpt2"})
    with pytest.raises(CheckpointError, match="config.json has no 'n_embd'"):
        read_config(locate(tmp_path))
