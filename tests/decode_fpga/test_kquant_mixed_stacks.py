"""A q|k|v or gate|up stack of mixed block formats (a Q4_K_M file of a 1B-class model: Q4_K q and k
beside a Q6_K v) served with no f32: each part a matrix in its own format writing its rows of the
stack (stacked_matrix.py). The stacked GEMVs (several rows, batch-invariant rows, the norm prologue,
both kernel shapes) against gguf's values, and a tiny Llama of such layers giving transformers'
greedy tokens in gpu, fpga and hybrid modes."""
from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from services.decode_fpga.stacked_matrix import StackedMatrix
from tests.decode_fpga.kquant_checkpoint import random_blocks, write_tiny_llama
from tests.decode_fpga.test_gemv_rows import check
from tests.decode_fpga.test_kquant_gemv import ggufs
from tests.decode_fpga.test_quant_gemv import gemv_dev, run_gemv  # noqa: F401 (fixture)

MF = cl.mem_flags
# per layer: q, k Q4_K and v Q6_K (as llama-quantize's Q4_K_M gives a 1B Llama's "more bits" layers),
# gate Q4_K beside up Q6_K; layer 1 mixes other formats (Q5_K|Q4_K|Q5_0 needs cols % 256 for Q5_K)
TYPES = {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q4_k", "ffn_gate": "q4_k",
         "ffn_up": "q6_k", "ffn_down": "q6_k", "token_embd": "q6_k",
         "blk.1.attn_q": "q5_k", "blk.1.attn_v": "q5_0", "blk.1.ffn_gate": "q6_k", "blk.1.ffn_up": "q5_1"}


def parts():
    return [random_blocks("q4_k", 40, 512, seed=1), random_blocks("q4_k", 24, 512, seed=2),
            random_blocks("q6_k", 24, 512, seed=3)]


def stacked_reference(ps, x: np.ndarray, y0: np.ndarray) -> np.ndarray:
    w = np.concatenate([ggufs(p) for p in ps]).astype(np.float64)
    return x.astype(np.float64) @ w.T + y0


@pytest.mark.parametrize("batch", [1, 9])
def test_stacked_gemv_is_ggufs(gemv_dev, batch):
    """Each part writes its own rows of y [batch, rows] (one row, the 8- and 4-row passes)."""
    ps = parts()
    m = StackedMatrix(gemv_dev, ps)
    rng = np.random.default_rng(batch)
    x = rng.normal(size=(batch, m.cols)).astype(np.float32)
    y0 = rng.normal(size=(batch, m.rows)).astype(np.float32)
    ref = stacked_reference(ps, x, y0)
    xb = cl.Buffer(gemv_dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=x)
    yb = cl.Buffer(gemv_dev.context, MF.READ_WRITE | MF.COPY_HOST_PTR, hostbuf=y0.copy())
    m.enqueue_gemv(gemv_dev.queue, xb, yb, batch, accumulate=True)
    got = np.empty_like(y0)
    cl.enqueue_copy(gemv_dev.queue, got, yb, is_blocking=True)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # each part's rows exactly what that part alone computes
    for p, lo in zip(ps, (0, 40, 64)):
        np.testing.assert_array_equal(got[:, lo:lo + p.rows], run_gemv(gemv_dev, p, x, y0[:, lo:lo + p.rows], True))


def test_parts_of_one_format_run_one_program_wherever_they_sit(gemv_dev):
    """A part's place in the stack is its kernels' arguments, not a define: q and k (both Q4_K, rows 0
    and 40 of 88) run the same programs, v (Q6_K) its own. Each define set was a PoCL build of its
    own (~1.5 s, then each kernel's code at its first launch), per part of every mixed layer."""
    m = StackedMatrix(gemv_dev, parts())
    x = cl.Buffer(gemv_dev.context, MF.READ_WRITE, size=4 * 4 * m.cols)
    y = cl.Buffer(gemv_dev.context, MF.READ_WRITE, size=4 * 4 * m.rows)
    xs = cl.Buffer(gemv_dev.context, MF.READ_WRITE, size=4 * 4 * m.cols // 32)
    w = cl.Buffer(gemv_dev.context, MF.READ_WRITE, size=4 * m.cols)

    def program(launch) -> int:
        return launch.kernel.get_info(cl.kernel_info.PROGRAM).int_ptr

    for bind in (lambda p: p.bind_gemv(x, y, 4, x_sums=xs), lambda p: p.bind_gemv_norm(x, w, 1e-5, y)):
        q, k, v = (program(bind(p)) for p in m.parts)
        assert q == k != v


def test_stacked_rows_are_one_row_gemvs(gemv_dev):
    """The paged step's GEMV over the stack: close to gguf's, every row bit for bit the one-row GEMV."""
    ps = parts()
    check(gemv_dev, StackedMatrix(gemv_dev, ps), lambda x, y0: stacked_reference(ps, x, y0), 4, True)


def test_stacked_norm_prologue(gemv_dev):
    ps = parts()
    m = StackedMatrix(gemv_dev, ps)
    rng = np.random.default_rng(6)
    x, nw = (rng.normal(size=m.cols).astype(np.float32) for _ in range(2))
    ctx, q = gemv_dev.context, gemv_dev.queue
    xb, nwb = (cl.Buffer(ctx, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=a) for a in (x, nw))
    yb = cl.Buffer(ctx, MF.READ_WRITE, m.rows * 4)
    m.bind_gemv_norm(xb, nwb, 1e-5, yb).enqueue(q)
    got = np.empty(m.rows, np.float32)
    cl.enqueue_copy(q, got, yb, is_blocking=True)
    x64 = x.astype(np.float64)
    ref = stacked_reference(ps, (x64 / np.sqrt((x64 ** 2).mean() + 1e-5) * nw)[None], np.zeros((1, m.rows)))[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.fixture(scope="module")
def mixed_stack_model(tmp_path_factory):
    from services.model.loading import load_model

    path = write_tiny_llama(tmp_path_factory.mktemp("kqm") / "tiny-mixed-stacks.gguf", TYPES, seed=11)
    return load_model(str(path))


def test_mixed_stacks_run_with_no_f32_and_give_transformers_tokens(mixed_stack_model):
    """Refused before (the stacks had no one format); now no matrix is f32, the stacks are their parts,
    and gpu, fpga and hybrid give transformers' greedy tokens (a 1- and a 23-token prompt)."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.decode_fpga.engine import OpenCLEngine
    from tests.decode_fpga.test_kquant_engine import settings
    from tests.stack.test_engine_runtime import assert_every_mode_gives, hybrid_in_process

    model = mixed_stack_model
    engine = OpenCLEngine.from_settings(model, settings())
    w = engine.weights
    assert "f32" not in engine.stored_weight_types
    assert all(src.lower() == dev for src, dev in w.stored.values())
    assert isinstance(w.layers[0].qkv, StackedMatrix) and w.layers[0].qkv.fmt == "q4_k+q4_k+q6_k"
    assert w.layers[1].gate_up.fmt == "q6_k+q5_1" and w.packed is None
    path = model.checkpoint.path
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with hybrid_in_process(model, engine, settings()) as (prefill, decode):
        assert_every_mode_gives(prefill, decode, hf, 10)
