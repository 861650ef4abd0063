"""The parts the OpenCL engine composes, each on its own: the config, the device weights' GGUF
assembly, and the paged KV store's hand-off imports (real OpenCL on PoCL)."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pyopencl as cl
import pytest
from gguf.quants import quantize

from services.decode_fpga.config import DeviceFit, EngineConfig
from services.decode_fpga.device import DeviceContext
from services.decode_fpga.device_weights import gguf_layer_tensors, gguf_weights
from services.decode_fpga.paged_attention import PagedKVLayout
from services.decode_fpga.paged_kv_store import PagedKVStore
from services.decode_fpga.quant_gemv import split_blocks
from services.decode_fpga.settings import DecodeSettings
from services.model.gguf_blocks import BlockTensor


# ---- EngineConfig / DeviceFit ----------------------------------------------------------------
@pytest.mark.parametrize("bad", [{"weights_dtype": "auto"}, {"weights_dtype": "int3"}, {"max_num_seqs": -1},
                                 {"max_context": 0}, {"max_context": 2.5}, {"max_num_seqs": True},
                                 {"kv_cache_mb": 0}, {"block_size": -16}, {"max_num_seqs": 0},
                                 {"max_num_batched_tokens": 1.5}])
def test_config_refuses_bad_values(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        EngineConfig(**bad)


def test_config_is_frozen_and_auto_storage_follows_the_checkpoint():
    config = EngineConfig.from_settings(DecodeSettings(max_context=512, max_num_seqs=2), "gguf")
    assert (config.weights_dtype, config.max_context, config.max_num_seqs) == ("gguf", 512, 2)
    batching = EngineConfig.from_settings(DecodeSettings(kv_cache_mb=64, block_size=32, max_num_seqs=8,
                                                         max_num_batched_tokens=256), "gguf")
    assert (batching.kv_cache_mb, batching.block_size, batching.max_num_seqs, batching.max_num_batched_tokens) == \
        (64, 32, 8, 512)  # built for the rows of a stretched step (stretched_batched_tokens, 512)
    rows = lambda **kw: EngineConfig.from_settings(DecodeSettings(max_num_batched_tokens=256, **kw),  # noqa: E731
                                                   "gguf").max_num_batched_tokens
    assert rows(stretched_batched_tokens=128) == 256 and rows(stretched_batched_tokens=1024) == 1024
    assert rows(ttft_target_s=0) == rows(step_target_s=0) == 256  # steps never stretch
    assert EngineConfig.from_settings(DecodeSettings(), "hf").weights_dtype == "fp32"
    assert EngineConfig.from_settings(DecodeSettings(weights_dtype="fp16"), "gguf").weights_dtype == "fp16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_context = 1


def test_device_fit_caps_the_context_and_decides_the_one_launch_step(model_config, cl_dev):
    fit = DeviceFit.of(EngineConfig(max_context=10 ** 6, max_num_batched_tokens=100), model_config, cl_dev)
    assert fit.max_context == model_config.max_context and fit.max_rows == 100  # a paged step's rows
    assert DeviceFit.of(EngineConfig(max_num_batched_tokens=600), model_config, cl_dev).max_rows == 600
    assert fit.one_launch_layers and fit.keep_cores_awake  # PoCL's device is a CPU
    assert not DeviceFit.of(EngineConfig(layer_kernels=False), model_config, cl_dev).one_launch_layers
    gpu_shaped = DeviceContext(cl_dev.device, cl_dev.context, cl_dev.queue, lanes=32)
    assert not DeviceFit.of(EngineConfig(), model_config, gpu_shaped).one_launch_layers


def test_engine_refuses_weights_of_another_format(ocl_engine, model_config, cl_dev):
    from services.decode_fpga.engine import OpenCLEngine

    with pytest.raises(ValueError, match="stored as gguf"):
        OpenCLEngine(model_config, cl_dev, EngineConfig(weights_dtype="gguf"), ocl_engine.weights)


# ---- the GGUF assembly ----------------------------------------------------------------------
def synthetic(name: str, qtype: str, rows: int, cols: int, seed: int) -> BlockTensor:
    w = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
    raw = quantize(w, gguf.GGMLQuantizationType[qtype.upper()]).view(np.uint8).reshape(rows, -1)
    return BlockTensor(name, qtype, rows, cols, raw)


def test_mixed_block_formats_keep_their_parts_and_a_part_in_no_block_format_comes_back_dense():
    parts = {"attn_q": "q4_1", "attn_k": "q8_0", "attn_v": "q4_1", "attn_output": "q4_0", "ffn_gate": "q4_1",
             "ffn_up": "q4_1", "ffn_down": "q8_0"}
    blocks = {f"blk.0.{n}.weight": synthetic(n, q, 8, 64, seed) for seed, (n, q) in enumerate(parts.items())}
    layer = gguf_layer_tensors(blocks, 0)
    # every part has a device kernel: each is kept in its own format (stacked_matrix.py), nothing dense
    assert layer["qkv"] == [blocks[f"blk.0.{n}.weight"] for n in ("attn_q", "attn_k", "attn_v")]
    assert (layer["gate_up"].qtype, layer["gate_up"].rows) == ("q4_1", 16)
    assert layer["o"] is blocks["blk.0.attn_output.weight"] and layer["down"] is blocks["blk.0.ffn_down.weight"]
    # a part in no block format (f16): dense with gguf's values, only where the fallback is allowed
    # (HYBRIDSERVE_DECODE_ALLOW_DENSE_FALLBACK); else refused, named
    from services.model.checkpoint import CheckpointError

    blocks["blk.0.attn_v.weight"] = synthetic("attn_v", "f16", 8, 64, 2)
    dense = gguf_layer_tensors(blocks, 0)["qkv"]
    want_qkv = np.concatenate([blocks[f"blk.0.{n}.weight"].dequantize() for n in ("attn_q", "attn_k", "attn_v")])
    assert isinstance(dense, np.ndarray) and dense.dtype == np.float32
    np.testing.assert_array_equal(dense, want_qkv)
    with pytest.raises(CheckpointError, match=r"layer 0: .*attn_q\|attn_k\|attn_v"):
        gguf_layer_tensors(blocks, 0, allow_dense_fallback=False)


def read(dev, buf: cl.Buffer, like: np.ndarray) -> np.ndarray:
    out = np.empty_like(like)
    cl.enqueue_copy(dev.queue, out, buf, is_blocking=True)
    return out


def test_packed_and_separate_gguf_layers_hold_the_same_bytes(ocl_gguf_engine, loaded_model, cl_dev):
    """The packed layers (decode_layers.cl's one buffer) and a buffer per matrix hold split_blocks'
    arrays of the same assembled tensors, byte for byte."""
    from services.model.gguf_blocks import read_block_tensors

    cfg = loaded_model.config
    blocks = read_block_tensors(loaded_model.checkpoint, cfg)
    packed = ocl_gguf_engine.weights
    separate = gguf_weights(cl_dev, cfg, loaded_model.weights, blocks, pack_layers=False)
    assert packed.packed is not None and separate.packed is None
    assert packed.nbytes == separate.nbytes == ocl_gguf_engine.weights_nbytes
    for li in (0, cfg.n_layers - 1):
        tensors = gguf_layer_tensors(blocks, li)
        for key in ("qkv", "o", "gate_up", "down"):
            d, m, q = split_blocks(tensors[key])
            for weights in (packed, separate):
                mat = getattr(weights.layers[li], key)
                d_buf, m_buf, q_buf = mat.device_arrays
                np.testing.assert_array_equal(read(cl_dev, d_buf, d), d, err_msg=key)
                np.testing.assert_array_equal(read(cl_dev, q_buf, q), q, err_msg=key)
                if m is not None:
                    np.testing.assert_array_equal(read(cl_dev, m_buf, m), m, err_msg=key)
        norm = np.ascontiguousarray(loaded_model.weights.layers[li].ffn_norm, np.float32)
        for weights in (packed, separate):
            np.testing.assert_array_equal(read(cl_dev, weights.layers[li].ffn_norm, norm), norm)
    assert packed.lm_head.fmt == separate.lm_head.fmt == blocks["token_embd.weight"].qtype


# ---- the paged KV store's hand-off imports --------------------------------------------------------
@pytest.fixture
def small_store(model_config, cl_dev):
    """Six blocks of 4 positions; tables of up to 16 positions."""
    c = model_config
    return PagedKVStore(cl_dev, c, PagedKVLayout(c.n_layers, c.n_kv_heads, c.head_dim, 4, 6), max_tokens=16)


def test_imported_kv_reads_back_per_table(small_store, model_config):
    c, rng = model_config, np.random.default_rng(7)
    tables = {5: [4, 1], 9: [0, 5, 2]}  # out of order; the 5 tokens' table and the 9's share no block
    wire = {}
    for n, table in tables.items():
        wire[n] = rng.normal(size=(c.n_layers, 2, c.n_kv_heads, n, c.head_dim)).astype(np.float16)
        for layer in range(c.n_layers):
            small_store.import_layer(table, layer, wire[n][layer])
        small_store.finish_import()
    np.testing.assert_array_equal(small_store.read(tables[5], 5), wire[5].astype(np.float32))
    np.testing.assert_array_equal(small_store.read(tables[9], 9), wire[9].astype(np.float32))  # 9 did not overwrite 5


def test_import_refuses_kv_that_does_not_fit(small_store, model_config):
    c = model_config
    with pytest.raises(ValueError, match="need 2 blocks"):
        small_store.import_layer([3], 0, np.zeros((2, c.n_kv_heads, 5, c.head_dim), np.float32))
    with pytest.raises(ValueError, match="outside"):
        small_store.import_layer([6], 0, np.zeros((2, c.n_kv_heads, 3, c.head_dim), np.float32))
    with pytest.raises(ValueError, match="shape"):
        small_store.import_layer([3], 0, np.zeros((2, c.n_kv_heads + 1, 3, c.head_dim), np.float32))
