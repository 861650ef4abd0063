"""decode_fpga leaves a GGUF file's matrices in the file: its gguf storage uploads the file's own blocks,
so the service loads the weights with gguf_matrices=False and never dequantizes the fp32 copy it would
not read (the default model: 538 MB and 3-4 s of every start). What it does load, the norms, biases and
the tie between the embedding and the LM head, must be what a full load gives; the engine built on it
must give the same tokens (every architecture's GGUF: tests/model/test_architecture_engines.py builds
its OpenCL engine this way); and the dense storages, which need the matrices, get them or say why not."""
from __future__ import annotations

import numpy as np
import pytest

from services.model.loading import load_model


@pytest.fixture(scope="module")
def in_file(loaded_model):
    return load_model(str(loaded_model.checkpoint.path), gguf_matrices=False)


def test_every_vector_is_loaded_the_matrices_are_not(loaded_model, in_file):
    full, w = loaded_model.weights, in_file.weights
    assert full.has_matrices and not w.has_matrices
    assert w.nbytes() < full.nbytes() / 100, (w.nbytes(), full.nbytes())
    assert (w.lm_head is w.embed) == (full.lm_head is full.embed)
    assert w.embed.shape == (0, full.embed.shape[1])
    np.testing.assert_array_equal(w.final_norm, full.final_norm)
    for a, b in zip(w.layers, full.layers):
        np.testing.assert_array_equal(a.attn_norm, b.attn_norm)
        np.testing.assert_array_equal(a.ffn_norm, b.ffn_norm)
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            assert getattr(a, name).shape == (0, getattr(b, name).shape[1]), name


@pytest.mark.slow
def test_an_engine_on_them_gives_the_same_tokens(in_file, cl_dev, ocl_gguf_engine, model_config):
    from services.model.gguf_blocks import read_block_tensors
    from tests.conftest import random_prompt
    from tests.decode_fpga.conftest import make_engine
    from tests.decode_fpga.test_opencl_engine import greedy

    engine = make_engine(in_file, cl_dev, weights_dtype="gguf", max_context=256, kv_cache_mb=8,
                         blocks=read_block_tensors(in_file.checkpoint, in_file.config))
    prompt = random_prompt(40, model_config.vocab_size, seed=5)
    assert greedy(engine, prompt, 12) == greedy(ocl_gguf_engine, prompt, 12)


def test_dense_storage_refuses_weights_without_their_matrices(in_file, cl_dev):
    from tests.decode_fpga.conftest import make_engine

    with pytest.raises(ValueError, match="loaded without them"):
        make_engine(in_file, cl_dev, weights_dtype="fp16", max_context=64)


@pytest.mark.parametrize("storage,matrices", [("auto", False), ("gguf", False), ("fp16", True), ("fp32", True)])
def test_the_service_loads_the_matrices_only_for_a_dense_storage(loaded_model, storage, matrices):
    from services.decode_fpga.server import load
    from services.decode_fpga.settings import DecodeSettings

    settings = DecodeSettings(model=str(loaded_model.checkpoint.path), weights_dtype=storage)
    assert load(settings).weights.has_matrices is matrices


@pytest.mark.parametrize("gguf_matrices", [True, False])
def test_a_matrix_of_the_wrong_shape_is_refused_whether_loaded_or_left_in_the_file(tmp_path, gguf_matrices):
    from services.model.checkpoint import CheckpointError
    from tests.model.tiny_checkpoints import save_gguf, tiny_model

    model = tiny_model("llama3")
    model.config.intermediate_size += 32  # the file's metadata; its MLP tensors keep their own shape
    path = save_gguf(model, "llama3", tmp_path / "wrong.gguf")
    with pytest.raises(CheckpointError, match=r"layer 0 w_(gate|up|down) tensor has shape"):
        load_model(str(path), gguf_matrices=gguf_matrices)
