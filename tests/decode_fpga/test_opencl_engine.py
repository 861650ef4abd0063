"""The OpenCL engine on the real model: token parity with the torch engine and transformers."""
from __future__ import annotations

import numpy as np
import pytest

from services.engine.api import EngineFull
from services.engine.generation import Generation
from services.engine.sampling import SamplingParams
from tests.conftest import random_prompt
from tests.decode_fpga.conftest import make_engine


def greedy(engine, prompt, n):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [ev.token for ev in Generation(engine, prompt, params, 8192)]


def test_prefill_logits_close_to_torch(ocl_engine, torch_engine, model_config):
    prompt = random_prompt(40, model_config.vocab_size, seed=12)
    a, b = ocl_engine.new_sequence(41), torch_engine.new_sequence(41)
    try:
        np.testing.assert_allclose(ocl_engine.prefill(a, prompt), torch_engine.prefill(b, prompt), atol=1e-3, rtol=0)
    finally:
        ocl_engine.release(a)


@pytest.mark.slow
def test_32_channels_give_the_same_tokens(loaded_model, cl_dev, ocl_engine, model_config):
    wide = make_engine(loaded_model, cl_dev, kv_channels=32, max_context=256, max_sequences=1)
    prompt = random_prompt(60, model_config.vocab_size, seed=13)
    assert greedy(wide, prompt, 24) == greedy(ocl_engine, prompt, 24)


@pytest.mark.slow
def test_fp16_weights_stay_close_to_fp32(loaded_model, cl_dev, ocl_engine, model_config):
    """fp16 storage (fp32 compute) is the opt-in speed setting; its logit error is bounded here."""
    half = make_engine(loaded_model, cl_dev, weights_dtype="fp16", max_context=256, max_sequences=1)
    for seed in (14, 15):
        prompt = random_prompt(30, model_config.vocab_size, seed=seed)
        a, b = half.new_sequence(31), ocl_engine.new_sequence(31)
        try:
            la, lb = half.prefill(a, prompt), ocl_engine.prefill(b, prompt)
        finally:
            half.release(a)
            ocl_engine.release(b)
        # measured here: max |diff| ~0.05-0.1 on logits of magnitude ~20
        assert np.abs(la - lb).max() < 0.5
        assert np.abs(la - lb).max() / np.abs(lb).max() < 0.02


def test_rows_left_on_the_device_serve_only_the_step_they_belong_to(ocl_engine, model_config):
    """A greedy step leaves its picks and next positions on the device, and a step with exactly those
    rows uploads nothing. Interleaved sequences, a reordered batch, a logits step and a token other
    than the last pick must each still see their own rows."""
    p1, p2 = (random_prompt(n, model_config.vocab_size, seed=n) for n in (5, 12))
    ref1, ref2 = greedy(ocl_engine, p1, 8), greedy(ocl_engine, p2, 8)
    a, b = ocl_engine.new_sequence(40), ocl_engine.new_sequence(40)
    try:
        out_a = [int(np.argmax(ocl_engine.prefill(a, p1)))]
        out_b = [int(np.argmax(ocl_engine.prefill(b, p2)))]
        for _ in range(2):  # the second reuses the first's rows
            out_a += ocl_engine.decode_greedy([a], out_a[-1:])
        out_b += ocl_engine.decode_greedy([b], out_b[-1:])
        tb, ta = ocl_engine.decode_greedy([b, a], [out_b[-1], out_a[-1]])
        out_a.append(ta), out_b.append(tb)
        ta, tb = ocl_engine.decode_greedy([a, b], [ta, tb])  # the same rows, reordered
        out_a.append(ta), out_b.append(tb)
        out_a.append(int(np.argmax(ocl_engine.decode([a], [ta])[0])))
        out_a += ocl_engine.decode_greedy([a], out_a[-1:])
        assert out_a == ref1[:len(out_a)] and out_b == ref2[:len(out_b)]
        forced = (out_a[-1] + 1) % model_config.vocab_size  # fed instead of the pick the device holds
        got = ocl_engine.decode_greedy([a], [forced])[0]
    finally:
        ocl_engine.release(a)
        ocl_engine.release(b)
    fresh = ocl_engine.new_sequence(40)
    try:
        want = int(np.argmax(ocl_engine.prefill(fresh, p1 + out_a[:-1] + [forced])))
    finally:
        ocl_engine.release(fresh)
    assert got == want


def test_imported_kv_lands_where_torch_keeps_it(ocl_engine, torch_engine, model_config):
    """The hybrid hand-off's receiving side: what is imported reads back as torch's own K.
    (That it then decodes like torch is in tests/stack/test_engine_contract.py.)"""
    prompt = random_prompt(21, model_config.vocab_size, seed=17)
    src = torch_engine.new_sequence(30)
    torch_engine.prefill(src, prompt)
    dst = ocl_engine.new_sequence(30)
    try:
        for layer in range(model_config.n_layers):
            ocl_engine.import_kv_layer(dst, layer, torch_engine.export_kv_layer(src, layer, len(prompt)).numpy())
        ocl_engine.finish_import(dst, len(prompt))
        np.testing.assert_allclose(ocl_engine.read_kv(dst, len(prompt))[3, 0],
                                   src.k[3, :, :len(prompt)].numpy())
    finally:
        ocl_engine.release(dst)
        torch_engine.release(src)


def test_slots_run_out_with_a_clear_error(loaded_model, cl_dev, ocl_engine):
    held = [ocl_engine.new_sequence(8) for _ in range(ocl_engine.kv.free_sequences)]
    try:
        with pytest.raises(EngineFull, match="sequence slots"):
            ocl_engine.new_sequence(8)
    finally:
        for s in held:
            ocl_engine.release(s)
    with pytest.raises(ValueError, match="exceeds the engine's context"):
        ocl_engine.new_sequence(ocl_engine.max_context + 1)


def test_no_matching_device_lists_what_is_present():
    from services.decode_fpga.device import DeviceSelectionError, select_device

    with pytest.raises(DeviceSelectionError, match="present: .*Portable Computing Language"):
        select_device(platform="Xilinx")
