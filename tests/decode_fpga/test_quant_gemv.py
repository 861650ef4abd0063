"""GEMV over GGUF blocks: against gguf's own dequantization + numpy, and the engine in gguf storage."""
from __future__ import annotations

import gguf
import numpy as np
import pyopencl as cl
import pytest
from gguf.quants import dequantize, quantize

from services.decode_fpga.quant_gemv import QuantMatrix
from services.model.gguf_blocks import BlockTensor, read_block_tensors, stack_rows

QTYPES = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
          "q8_0": gguf.GGMLQuantizationType.Q8_0}
MF = cl.mem_flags


@pytest.fixture(scope="module")
def blocks(loaded_model):
    return read_block_tensors(loaded_model.checkpoint, loaded_model.config)


@pytest.fixture(scope="module", params=[1, 32], ids=["item-per-row", "lanes32"])
def gemv_dev(cl_dev, request):
    """The device with each block-GEMV kernel: one work-item per output row (gemv_quant.cl, a CPU's
    or an FPGA's default) and 32 lanes per row (gemv_quant_wg.cl, a GPU's), whatever the device is."""
    from services.decode_fpga.device import DeviceContext

    return DeviceContext(cl_dev.device, cl_dev.context, cl_dev.queue, lanes=request.param)


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
def test_block_gemv_matches_gguf_dequantize(gemv_dev, qtype, batch, accumulate):
    t = synthetic(qtype, 70, 96 + 32 * batch)  # odd block counts too
    rng = np.random.default_rng(batch)
    x = rng.normal(size=(batch, t.cols)).astype(np.float32)
    y0 = rng.normal(size=(batch, t.rows)).astype(np.float32)
    got = run_gemv(gemv_dev, t, x, y0, accumulate)
    ref = reference(t, x, y0, accumulate)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("n_blocks", [1, 2, 3, 5, 6, 7, 18])
def test_one_row_gemv_any_block_count(gemv_dev, qtype, n_blocks):
    """One row takes the path with the scales out of the inner loop (and Q4_1's block sums):
    4 blocks at a time, then a tail of 1-3."""
    t = synthetic(qtype, 37, 32 * n_blocks, seed=n_blocks)
    rng = np.random.default_rng(n_blocks)
    x = rng.normal(size=(1, t.cols)).astype(np.float32)
    y0 = rng.normal(size=(1, t.rows)).astype(np.float32)
    ref = reference(t, x, y0, True)
    np.testing.assert_allclose(run_gemv(gemv_dev, t, x, y0, True), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemv_with_fused_rms_norm(gemv_dev, qtype, accumulate):
    """gemv_quant_norm(_wg) (one decode row): y (+)= W rms_norm(x, w), the norm made by each
    work-group in local memory; 200 rows, so several work-groups each make it."""
    t = synthetic(qtype, 200, 576, seed=4)
    rng = np.random.default_rng(4)
    x, w = rng.normal(size=576).astype(np.float32), rng.normal(size=576).astype(np.float32)
    y0 = rng.normal(size=200).astype(np.float32)
    m = QuantMatrix(gemv_dev, t)
    yb = cl.Buffer(gemv_dev.context, MF.READ_WRITE | MF.COPY_HOST_PTR, hostbuf=y0.copy())
    xb, wb = (cl.Buffer(gemv_dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=a) for a in (x, w))
    launch = m.bind_gemv_norm(xb, wb, 1e-5, yb, accumulate)
    if m.lanes == 1:  # 5 work-groups of 40 rows, each making the norm
        cl.enqueue_nd_range_kernel(gemv_dev.queue, launch.kernel, launch.global_size, (40,))
    else:  # a work-group per row
        launch.enqueue(gemv_dev.queue)
    got = np.empty(200, np.float32)
    cl.enqueue_copy(gemv_dev.queue, got, yb, is_blocking=True)
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt((x64 ** 2).mean() + 1e-5) * w
    ref = reference(t, xn[None].astype(np.float32), y0[None], accumulate)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemv_with_fused_silu(cl_dev, qtype, accumulate):
    """gemv_quant_silu (one decode row, one work-item per row): y (+)= W (silu(gate) * up), the
    activation made by each work-group in local memory. Against numpy, and bit for bit against
    the two launches it replaces (silu_mul, then the GEMV), whose outputs it must not change."""
    ff, rows = 1536, 200
    t = synthetic(qtype, rows, ff, seed=6)
    rng = np.random.default_rng(6)
    gu = rng.normal(size=2 * ff).astype(np.float32)
    y0 = rng.normal(size=rows).astype(np.float32)
    m = QuantMatrix(cl_dev, t)
    assert m.fuses_silu
    gub = cl.Buffer(cl_dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=gu)
    yb = cl.Buffer(cl_dev.context, MF.READ_WRITE | MF.COPY_HOST_PTR, hostbuf=y0.copy())
    launch = m.bind_gemv_silu(gub, yb, accumulate)
    # 5 work-groups of 40 rows, each making the activation
    cl.enqueue_nd_range_kernel(cl_dev.queue, launch.kernel, launch.global_size, (40,))
    got = np.empty(rows, np.float32)
    cl.enqueue_copy(cl_dev.queue, got, yb, is_blocking=True)
    g = gu[:ff].astype(np.float64)
    act = g / (1 + np.exp(-g)) * gu[ff:]
    ref = reference(t, act[None].astype(np.float32), y0[None], accumulate)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

    act_b = cl.Buffer(cl_dev.context, MF.READ_WRITE, ff * 4)
    sums_b = cl.Buffer(cl_dev.context, MF.READ_WRITE, ff // 32 * 4)
    y2 = cl.Buffer(cl_dev.context, MF.READ_WRITE | MF.COPY_HOST_PTR, hostbuf=y0.copy())
    cl_dev.build("elementwise.cl", {"ARGMAX_WG": 256}).silu_mul(cl_dev.queue, (1, ff // 32), None, gub, act_b,
                                                              sums_b, np.int32(ff))
    m.bind_gemv(act_b, y2, 1, accumulate, x_sums=sums_b).enqueue(cl_dev.queue)
    two_launches = np.empty(rows, np.float32)
    cl.enqueue_copy(cl_dev.queue, two_launches, y2, is_blocking=True)
    np.testing.assert_array_equal(got, two_launches)


def test_fused_silu_is_offered_only_where_it_runs(cl_dev):
    """The work-group-per-row (GPU) kernels and partial blocks keep the separate silu_mul."""
    from services.decode_fpga.device import DeviceContext

    gpu_shaped = DeviceContext(cl_dev.device, cl_dev.context, cl_dev.queue, lanes=32)
    m = QuantMatrix(gpu_shaped, synthetic("q4_1", 8, 64))
    assert not m.fuses_silu
    buf = cl.Buffer(cl_dev.context, MF.READ_WRITE, 1024)
    with pytest.raises(ValueError, match="no fused SiLU"):
        m.bind_gemv_silu(buf, buf)


@pytest.mark.parametrize("lanes", [3, 512])
def test_lanes_must_be_a_power_of_two_up_to_256(cl_dev, lanes):
    from services.decode_fpga.device import DeviceContext

    dev = DeviceContext(cl_dev.device, cl_dev.context, cl_dev.queue, lanes=lanes)
    with pytest.raises(ValueError, match="power of two"):
        QuantMatrix(dev, synthetic("q4_1", 4, 64))


def test_lanes_setting(monkeypatch):
    from pydantic import ValidationError

    from services.decode_fpga.settings import DecodeSettings

    monkeypatch.setenv("HYBRIDSERVE_OPENCL_LANES", "64")
    assert DecodeSettings().opencl_lanes == 64
    for bad in ("-1", "3", "512"):
        monkeypatch.setenv("HYBRIDSERVE_OPENCL_LANES", bad)
        with pytest.raises(ValidationError):
            DecodeSettings()


def test_q4_1_gemv_without_block_sums_is_refused(cl_dev):
    """One work-item per row reads Q4_1's block sums of x; the lanes-per-row kernel needs none."""
    from services.decode_fpga.device import DeviceContext

    one, lanes = (DeviceContext(cl_dev.device, cl_dev.context, cl_dev.queue, lanes=n) for n in (1, 32))
    x = cl.Buffer(cl_dev.context, MF.READ_WRITE, 64 * 4)
    with pytest.raises(ValueError, match="block sums"):
        QuantMatrix(one, synthetic("q4_1", 4, 64)).bind_gemv(x, x, 1)
    assert not QuantMatrix(lanes, synthetic("q4_1", 4, 64)).needs_block_sums


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.7.attn_q.weight", "token_embd.weight"])
def test_real_tensors_match(cl_dev, blocks, name, batch):
    t = blocks[name]
    x = np.random.default_rng(3).normal(size=(batch, t.cols)).astype(np.float32)
    y0 = np.zeros((batch, t.rows), np.float32)
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
    if n_prompt < 512:  # and to the fp32 storage of the same weights; at 512 test_engine_contract.py's
        # [ocl_engine-512-64-11] checks that storage against the same reference (same prompt and seed)
        assert ours == greedy(ocl_engine, prompt, n_new)


@pytest.mark.slow
def test_gpu_shaped_kernels_greedy_identical_to_transformers(loaded_model, cl_dev, hf_model, model_config):
    """The engine on the kernels a GPU gets, 32 lanes per GEMV row (here forced onto this device): the
    same greedy tokens as transformers, a prefill of several rows and one-row decode steps."""
    from services.decode_fpga.device import DeviceContext
    from tests.conftest import hf_greedy, random_prompt
    from tests.decode_fpga.conftest import make_engine
    from tests.decode_fpga.test_opencl_engine import greedy

    dev = DeviceContext(cl_dev.device, cl_dev.context, cl_dev.queue, lanes=32)
    engine = make_engine(loaded_model, dev, weights_dtype="gguf", max_context=64, kv_cache_mb=4,
                         blocks=read_block_tensors(loaded_model.checkpoint, model_config))
    layer = engine.weights.layers[0]
    assert layer.gate_up.lanes == 32 and not layer.down.needs_block_sums
    prompt = random_prompt(17, model_config.vocab_size, seed=12)
    assert greedy(engine, prompt, 12) == hf_greedy(hf_model, prompt, 12)


def test_gguf_reads_a_fraction_of_fp32s_bytes(ocl_gguf_engine, ocl_engine):
    assert ocl_gguf_engine.weights_nbytes < 0.3 * ocl_engine.weights_nbytes


def test_auto_storage_is_gguf_for_a_gguf_checkpoint(loaded_model):
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.settings import DecodeSettings

    engine = OpenCLEngine.from_settings(loaded_model, DecodeSettings(max_context=64, max_sequences=1))
    assert engine.weights_dtype == "gguf"


# ---- the block layer and the kernels in detail (gguf_blocks.py, quant_gemv.py, gemv_quant.cl) ----

@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_kernel_weights_are_ggufs_bit_for_bit(gemv_dev, qtype):
    """One-hot rows of x read the matrix back through the kernel: exactly gguf's values."""
    t = synthetic(qtype, 37, 160, seed=4)  # 5 blocks per row: the 4-block loop and its tail
    eye = np.eye(t.cols, dtype=np.float32)
    got = run_gemv(gemv_dev, t, eye, np.zeros((t.cols, t.rows), np.float32), False)
    np.testing.assert_array_equal(got.T, t.dequantize())


@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("batch", [5, 8, 16])
def test_batched_gemv_past_one_tile(gemv_dev, qtype, batch):
    t = synthetic(qtype, 45, 576, seed=batch)
    rng = np.random.default_rng(batch)
    x = rng.normal(size=(batch, t.cols)).astype(np.float32)
    y0 = rng.normal(size=(batch, t.rows)).astype(np.float32)
    ref = reference(t, x, y0, True)
    np.testing.assert_allclose(run_gemv(gemv_dev, t, x, y0, True), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("batch", [1, 8])
def test_lm_head_q8_0(gemv_dev, blocks, batch):
    """The real 49152x576 Q8_0 output matrix, batch 1 and 8."""
    t = blocks["token_embd.weight"]
    assert t.qtype == "q8_0"
    x = np.random.default_rng(batch).normal(size=(batch, t.cols)).astype(np.float32)
    ref = x.astype(np.float64) @ t.dequantize().astype(np.float64).T
    got = run_gemv(gemv_dev, t, x, np.zeros((batch, t.rows), np.float32), False)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_layer_matrices_equal_the_dense_weights(cl_dev, loaded_model, blocks):
    """The GGUF assembly the engine uses (device_weights.gguf_layer_tensors), uploaded, against
    load_weights' fp32 matrices."""
    from services.decode_fpga.device_weights import gguf_layer_tensors, gguf_lm_head_tensor
    from services.decode_fpga.quant_gemv import upload_block_matrix

    cfg, lw = loaded_model.config, loaded_model.weights.layers[5]
    mats = {k: upload_block_matrix(cl_dev, t) for k, t in gguf_layer_tensors(blocks, 5).items()}
    dense = {"qkv": np.concatenate([lw.wq, lw.wk, lw.wv]), "o": lw.wo,
             "gate_up": np.concatenate([lw.w_gate, lw.w_up]), "down": lw.w_down}
    rng = np.random.default_rng(5)
    for name, w in dense.items():
        m = mats[name]
        assert (m.rows, m.cols, m.fmt) == (*w.shape, "q4_1"), name
        x = rng.normal(size=(3, m.cols)).astype(np.float32)
        xb = cl.Buffer(cl_dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=x)
        yb = cl.Buffer(cl_dev.context, MF.READ_WRITE, 3 * m.rows * 4)
        m.enqueue_gemv(cl_dev.queue, xb, yb, 3)
        got = np.empty((3, m.rows), np.float32)
        cl.enqueue_copy(cl_dev.queue, got, yb, is_blocking=True)
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=name)
    head = upload_block_matrix(cl_dev, gguf_lm_head_tensor(blocks))
    assert (head.rows, head.cols, head.fmt) == (cfg.vocab_size, cfg.hidden, "q8_0")


def test_layer_blocks_unpermuted_and_stacked(loaded_model, blocks):
    from services.decode_fpga.device_weights import gguf_layer_tensors

    lw = loaded_model.weights.layers[0]
    layer = gguf_layer_tensors(blocks, 0)
    np.testing.assert_array_equal(layer["qkv"].dequantize(), np.concatenate([lw.wq, lw.wk, lw.wv]))
    np.testing.assert_array_equal(layer["gate_up"].dequantize(), np.concatenate([lw.w_gate, lw.w_up]))
    np.testing.assert_array_equal(layer["o"].dequantize(), lw.wo)
    np.testing.assert_array_equal(layer["down"].dequantize(), lw.w_down)


def test_embedding_rows_dequantize_as_gguf(blocks, loaded_model):
    from services.model.gguf_blocks import dequantize_rows

    ids = np.array([0, 2, 17, 49151, 17])
    np.testing.assert_array_equal(dequantize_rows(blocks["token_embd.weight"], ids), loaded_model.weights.embed[ids])


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_device_arrays_hold_the_blocks_values(qtype):
    """split_blocks only moves bytes: scales, mins and quants rebuild gguf's weights exactly."""
    from services.decode_fpga.quant_gemv import split_blocks

    t = synthetic(qtype, 6, 96, seed=2)  # 3 blocks: scales padded to 4
    d, m, q = split_blocks(t)
    assert d.shape == (6, 4) and not d[:, 3].any()
    assert d.dtype == np.float32  # the fp16 scales widened, exactly
    d = d[:, :3, None]
    if qtype == "q8_0":
        w = q.view(np.int8).reshape(6, 3, 32).astype(np.float32) * d
    else:
        qb = q.reshape(6, 3, 16)
        nib = np.concatenate([qb & 0x0F, qb >> 4], axis=2).astype(np.float32)
        w = (nib - 8) * d if qtype == "q4_0" else nib * d + m[:, :3, None].astype(np.float32)
    np.testing.assert_array_equal(w.reshape(6, 96), t.dequantize())


def test_dense_gguf_tensors_go_dense(cl_dev):
    from services.decode_fpga.quant_gemv import upload_block_matrix

    w = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float16)
    t = BlockTensor("f16", "f16", 8, 64, w.view(np.uint8).reshape(8, -1))
    m = upload_block_matrix(cl_dev, t)
    assert (m.fmt, m.rows, m.cols) == ("fp16", 8, 64)
    np.testing.assert_array_equal(t.dequantize(), w.astype(np.float32))


def test_unsupported_and_malformed_blocks_are_refused():
    from services.model.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="expected uint8"):
        BlockTensor("w", "q4_1", 4, 64, np.zeros((4, 39), np.uint8))
    with pytest.raises(CheckpointError, match="whole number"):
        BlockTensor("w", "q8_0", 4, 48, np.zeros((4, 51), np.uint8))


def test_types_without_a_kernel_fall_back_to_exact_f32(tmp_path):
    """A Q2_K tensor (no kernel here) comes back dense with gguf's values, or is refused."""
    from services.model.checkpoint import CheckpointError
    from services.model.gguf_blocks import GGUFBlocks
    from tests.decode_fpga.kquant_checkpoint import random_raw

    q2 = random_raw("q2_k", 4, 256)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("w.weight", q2, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    src = GGUFBlocks(tmp_path / "t.gguf")
    with pytest.raises(CheckpointError, match="no device kernel"):
        src.tensor("w.weight")
    t = src.tensor("w.weight", dense_fallback=True)
    assert (t.qtype, t.rows, t.cols, t.source) == ("f32", 4, 256, "Q2_K")
    np.testing.assert_array_equal(t.dequantize(), dequantize(q2, gguf.GGMLQuantizationType.Q2_K).reshape(4, 256))


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_embed_rows_from_blocks(cl_dev, qtype):
    """The device lookup dequantizes rows exactly as gguf does (repeated ids, the last row, a tail)."""
    t = synthetic(qtype, 50, 160, seed=6)
    m = QuantMatrix(cl_dev, t)
    ids = np.array([3, 49, 0, 3], np.int32)
    tb = cl.Buffer(cl_dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=ids)
    xb = cl.Buffer(cl_dev.context, MF.READ_WRITE, ids.size * t.cols * 4)
    m.enqueue_embed(cl_dev.queue, tb, xb, ids.size)
    got = np.empty((ids.size, t.cols), np.float32)
    cl.enqueue_copy(cl_dev.queue, got, xb, is_blocking=True)
    np.testing.assert_array_equal(got, t.dequantize()[ids])


def test_embed_rows_of_the_real_embedding(cl_dev, blocks, loaded_model):
    m = QuantMatrix(cl_dev, blocks["token_embd.weight"])
    ids = np.array([0, 1, 2, 100, 49151], np.int32)
    tb = cl.Buffer(cl_dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=ids)
    xb = cl.Buffer(cl_dev.context, MF.READ_WRITE, ids.size * m.cols * 4)
    m.enqueue_embed(cl_dev.queue, tb, xb, ids.size)
    got = np.empty((ids.size, m.cols), np.float32)
    cl.enqueue_copy(cl_dev.queue, got, xb, is_blocking=True)
    np.testing.assert_array_equal(got, loaded_model.weights.embed[ids])
