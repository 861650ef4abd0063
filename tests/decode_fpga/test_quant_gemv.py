"""GEMV over GGUF blocks: against gguf's own dequantization + numpy, and the engine in gguf storage."""
from __future__ import annotations

import gguf
import numpy as np
import pyopencl as cl
import pytest
from gguf.quants import dequantize, quantize

from services.decode_fpga.quant_gemv import QuantMatrix
from services.gguf_blocks import BlockTensor, read_block_tensors, stack_rows

QTYPES = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
          "q8_0": gguf.GGMLQuantizationType.Q8_0}
MF = cl.mem_flags


@pytest.fixture(scope="module")
def blocks(loaded_model):
    return read_block_tensors(loaded_model.checkpoint, loaded_model.config)


def synthetic(qtype: str, rows: int, cols: int, seed: int = 0) -> BlockTensor:
    w = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
    return BlockTensor("w", qtype, rows, cols, quantize(w, QTYPES[qtype]).reshape(rows, -1))


def run_gemv(cl_dev, t: BlockTensor, x: np.ndarray, y0: np.ndarray, accumulate: bool) -> np.ndarray:
    m = QuantMatrix(cl_dev, t)
    xb = cl.Buffer(cl_dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=x)
    yb = cl.Buffer(cl_dev.context, MF.READ_WRITE | MF.COPY_HOST_PTR, hostbuf=y0.copy())
    m.enqueue_gemv(cl_dev.queue, xb, yb, x.shape[0], accumulate)
    out = np.empty_like(y0)
    cl.enqueue_copy(cl_dev.queue, out, yb, is_blocking=True)
    return out


def reference(t: BlockTensor, x: np.ndarray, y0: np.ndarray, accumulate: bool) -> np.ndarray:
    w = dequantize(t.data, QTYPES[t.qtype]).reshape(t.rows, t.cols).astype(np.float64)
    return x.astype(np.float64) @ w.T + (y0 if accumulate else 0)


@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("accumulate", [False, True])
def test_block_gemv_matches_gguf_dequantize(cl_dev, qtype, batch, accumulate):
    t = synthetic(qtype, 70, 96 + 32 * batch)  # odd block counts too
    rng = np.random.default_rng(batch)
    x = rng.normal(size=(batch, t.cols)).astype(np.float32)
    y0 = rng.normal(size=(batch, t.rows)).astype(np.float32)
    got = run_gemv(cl_dev, t, x, y0, accumulate)
    ref = reference(t, x, y0, accumulate)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.7.attn_q.weight", "token_embd.weight"])
def test_real_tensors_match(cl_dev, blocks, name):
    t = blocks[name]
    x = np.random.default_rng(3).normal(size=(2, t.cols)).astype(np.float32)
    y0 = np.zeros((2, t.rows), np.float32)
    ref = x.astype(np.float64) @ t.dequantize().astype(np.float64).T
    np.testing.assert_allclose(run_gemv(cl_dev, t, x, y0, False), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_block_dequantize_is_ggufs(qtype):
    t = synthetic(qtype, 5, 64, seed=9)
    np.testing.assert_array_equal(t.dequantize(), dequantize(t.data, QTYPES[qtype]).reshape(5, 64))


def test_stacked_unpermuted_blocks_equal_the_dense_weights(blocks, loaded_model):
    layer = loaded_model.weights.layers[3]
    qkv = stack_rows("qkv", [blocks[f"blk.3.{n}.weight"] for n in ("attn_q", "attn_k", "attn_v")])
    np.testing.assert_array_equal(qkv.dequantize(), np.concatenate([layer.wq, layer.wk, layer.wv]))
    np.testing.assert_array_equal(blocks["token_embd.weight"].dequantize(), loaded_model.weights.embed)


def test_mixed_formats_do_not_stack():
    with pytest.raises(ValueError, match="formats differ"):
        stack_rows("x", [synthetic("q4_0", 4, 64), synthetic("q8_0", 4, 64)])


@pytest.mark.slow
@pytest.mark.parametrize("n_prompt,n_new", [(1, 64), (17, 16), (128, 16), (512, 64)])
def test_gguf_storage_greedy_identical_to_transformers(ocl_gguf_engine, ocl_engine, hf_model, model_config, n_prompt,
                                                       n_new):
    from tests.conftest import hf_greedy, random_prompt
    from tests.decode_fpga.test_opencl_engine import greedy

    prompt = random_prompt(n_prompt, model_config.vocab_size, seed=11)
    ours = greedy(ocl_gguf_engine, prompt, n_new)
    assert ours == hf_greedy(hf_model, prompt, n_new)
    assert ours == greedy(ocl_engine, prompt, n_new)  # and to the fp32 storage of the same weights


def test_gguf_reads_a_fraction_of_fp32s_bytes(ocl_gguf_engine, ocl_engine):
    assert ocl_gguf_engine.weights_nbytes < 0.3 * ocl_engine.weights_nbytes


def test_auto_storage_is_gguf_for_a_gguf_checkpoint(loaded_model):
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.settings import DecodeSettings

    engine = OpenCLEngine.from_settings(loaded_model, DecodeSettings(max_context=64, max_sequences=1))
    assert engine.weights_dtype == "gguf"
