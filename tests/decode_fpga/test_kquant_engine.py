"""K-quant GGUF files served by the engines: tiny Llamas made at test time from random blocks (no
llama.cpp), stored on the device as their own blocks (no matrix as f32), greedy tokens equal to
transformers on the same file in gpu, fpga and hybrid modes; the one-launch layers bit for bit the
launch-by-launch step for every type; types without a kernel refused unless the fallback is allowed."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from services.decode_fpga.engine import OpenCLEngine
from services.decode_fpga.one_launch_choice import OneLaunchChoice
from services.decode_fpga.settings import DecodeSettings
from services.model.checkpoint import CheckpointError
from services.model.loading import load_model
from tests.conftest import random_prompt
from tests.decode_fpga.kquant_checkpoint import write_tiny_llama
from tests.decode_fpga.test_paged_step import decode_logits, few_rows_logits, scattered_tables
from tests.engine.step_calls import prompt_logits

KTYPES = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
# what a Q4_K_M-like file of rows not all multiples of 256 holds: K-quants on the 256-wide rows
# (hidden 256), 5-bit legacy blocks on ffn_down (intermediate 608 = 19 blocks of 32), a type per
# layer and matrix, so every one of the five is read
MIXED = {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q4_k", "attn_output": "q6_k", "ffn_gate": "q5_k",
         "ffn_up": "q5_k", "ffn_down": "q5_0", "token_embd": "q6_k",
         **{f"blk.1.{n}": "q6_k" for n in ("attn_q", "attn_k", "attn_v")}, "blk.1.attn_output": "q4_k",
         "blk.1.ffn_gate": "q4_k", "blk.1.ffn_up": "q4_k", "blk.1.ffn_down": "q5_1"}


def settings(**kw) -> DecodeSettings:
    return DecodeSettings(max_context=128, max_sequences=1, kv_cache_mb=8, profile_at_start=False, **kw)


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("kq") / "tiny-q4_k_m.gguf", MIXED, intermediate=608, seed=3)
    return load_model(str(path))


@pytest.fixture(scope="module")
def mixed_engine(mixed_model):
    return OpenCLEngine.from_settings(mixed_model, settings())


@pytest.fixture(scope="module")
def mixed_hf(mixed_model):
    import torch
    from transformers import AutoModelForCausalLM

    path = mixed_model.checkpoint.path
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_every_matrix_is_stored_in_its_own_format(mixed_engine):
    """No matrix of the file on the device as f32: each its own block format, the log and Info say so."""
    w = mixed_engine.weights
    assert mixed_engine.weights_dtype == "gguf"
    assert mixed_engine.stored_weight_types == {"q4_k": 6, "q5_k": 2, "q6_k": 5, "q5_0": 1, "q5_1": 1}
    assert all(src.lower() == dev for src, dev in w.stored.values())
    assert {w.layers[0].qkv.fmt, w.layers[1].down.fmt, w.lm_head.fmt} == {"q4_k", "q5_1", "q6_k"}
    assert "Q5_0→q5_0 x1" in w.storage_summary() and "f32" not in w.storage_summary()


def test_three_modes_give_transformers_tokens(mixed_model, mixed_engine, mixed_hf, tmp_path):
    """gpu (the torch engine, which dequantizes at load), fpga and hybrid (the decode engine on the
    blocks, its engine loop and paged step) give transformers' greedy tokens; Info names the types."""
    from services.rpc.hybridserve.v1 import engine_pb2 as pb
    from tests.stack.test_engine_runtime import assert_every_mode_gives, hybrid_in_process

    with hybrid_in_process(mixed_model, mixed_engine, settings()) as (prefill, decode):
        assert_every_mode_gives(prefill, decode, mixed_hf, 12)
        info = pb.InfoResponse(**decode.info_fields())
        assert dict(info.stored_weight_types) == mixed_engine.stored_weight_types


@pytest.mark.usefixtures("cpu_device")
@pytest.mark.parametrize("qtype", [*KTYPES, "mixed"])
def test_one_launch_layers_bit_for_bit_per_type(tmp_path, cl_dev, qtype):
    """Every layer matrix in one format (or, "mixed", MIXED's five formats across matrices and layers),
    packed for decode_layers.cl: its one launch of a paged decode step gives the launch-by-launch
    step's logits bit for bit (each launch is held to gguf's values by test_kquant_gemv.py)."""
    from services.model.gguf_blocks import read_block_tensors
    from tests.decode_fpga.conftest import make_engine

    if qtype == "mixed":
        path, want = write_tiny_llama(tmp_path / "mixed.gguf", MIXED, intermediate=608, seed=7), tuple(sorted(KTYPES))
    else:
        names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        path = write_tiny_llama(tmp_path / f"{qtype}.gguf", {"token_embd": "q6_k", **{n: qtype for n in names}}, seed=7)
        want = (qtype,)
    model = load_model(str(path))
    engine = make_engine(model, cl_dev, blocks=read_block_tensors(model.checkpoint, model.config),
                         weights_dtype="gguf", max_context=64, kv_cache_mb=2)
    assert engine.weights.packed is not None and engine.weights.packed.qfmts == want
    # one work-group: its barriers never wait for another, so the one launch runs even beside busy
    # processes (with several, it gives up and the step is redone launch by launch); the rows each
    # computes are the same
    engine.paged_plans.one_launch = engine.paged_plans._bind_one_launch(1)
    prompt = random_prompt(9, model.config.vocab_size, seed=8)
    table = scattered_tables(engine, [len(prompt) + 8], seed=9)[0]
    out = {}
    for one_launch in (True, False):
        choice = engine.one_launch_choice = OneLaunchChoice(fixed=one_launch)
        out[one_launch] = decode_logits(engine, prompt, table, 6)
        if one_launch:
            assert choice.ran[True] == 6 and not choice.gave_up
    np.testing.assert_array_equal(out[True], out[False])
    # and steps of 2-4 rows (paged_rows_layers): several sequences' decodes, chunks of 3 and 4
    engine.paged_plans.one_launch_rows = engine.paged_plans._bind_rows_launch(1)
    prompts = [random_prompt(n, model.config.vocab_size, seed=10 + n) for n in (9, 26, 3)]
    tables = scattered_tables(engine, [n + 20 for n in (9, 26, 3)], seed=13)
    rows = {}
    for one_launch in (True, False):
        engine.rows_launch_choices = {n: OneLaunchChoice(fixed=one_launch, rows=n) for n in (2, 3, 4)}
        rows[one_launch] = few_rows_logits(engine, prompts, tables)
    for i, (a, b) in enumerate(zip(rows[True], rows[False])):
        np.testing.assert_array_equal(a, b, err_msg=f"step {i}")


@pytest.fixture(scope="module")
def unsupported_file(tmp_path_factory):
    """A Q2_K matrix (no device kernel) among Q4_K ones."""
    types = {n: "q4_k" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    return write_tiny_llama(tmp_path_factory.mktemp("q2") / "q2.gguf", {**types, "token_embd": "q6_k",
                                                                          "blk.0.ffn_down": "q2_k"}, n_layers=1)


def test_a_type_without_a_kernel_is_refused_at_start(unsupported_file):
    model = load_model(str(unsupported_file))
    with pytest.raises(CheckpointError, match=r"Q2_K \(1 tensors, e\.g\. blk\.0\.ffn_down\.weight\).*Q4_K.*"
                                              r"HYBRIDSERVE_DECODE_ALLOW_DENSE_FALLBACK"):
        OpenCLEngine.from_settings(model, settings())


def test_the_dense_fallback_when_allowed(unsupported_file, monkeypatch, caplog):
    """HYBRIDSERVE_DECODE_ALLOW_DENSE_FALLBACK=true: the Q2_K matrix stored as f32 (gguf's values),
    said in the log and the counts; the engine runs."""
    monkeypatch.setenv("HYBRIDSERVE_DECODE_ALLOW_DENSE_FALLBACK", "true")
    model = load_model(str(unsupported_file))
    with caplog.at_level(logging.INFO, logger="services.decode_fpga.engine"):
        engine = OpenCLEngine.from_settings(model, settings())
    assert engine.stored_weight_types == {"q4_k": 6, "f32": 1, "q6_k": 1}
    assert any("Q2_K→f32 x1" in r.getMessage() for r in caplog.records)
    assert np.isfinite(prompt_logits(engine, [5, 6, 7])).all()


def test_the_service_refuses_it_in_one_line(unsupported_file):
    """`python -m services.decode_fpga` on that file: exit status 2, the reason in one log line."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HYBRIDSERVE_MODEL": str(unsupported_file), "HYBRIDSERVE_PROFILE_AT_START": "false"}
    r = subprocess.run([sys.executable, "-m", "services.decode_fpga"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "cannot serve" in r.stderr and "Q2_K" in r.stderr and "ALLOW_DENSE_FALLBACK" in r.stderr
