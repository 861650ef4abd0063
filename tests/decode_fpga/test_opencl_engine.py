"""The OpenCL engine on the real model: logits close to the torch engine's, fp16 weights close to fp32,
and KV imported into its blocks as torch keeps it. (Its tokens equal to transformers' and the torch
engine's are in tests/stack/test_engine_contract.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from services.engine.one_request import greedy_tokens
from tests.conftest import random_prompt
from tests.decode_fpga.conftest import make_engine
from tests.engine.local_handoff import prefilled_kv
from tests.engine.step_calls import prompt_logits


def greedy(engine, prompt, n):
    """n greedy tokens, the request through an engine loop of its own (other tests import this)."""
    return greedy_tokens(engine, prompt, n)


def test_prefill_logits_close_to_torch(ocl_engine, torch_engine, model_config):
    prompt = random_prompt(40, model_config.vocab_size, seed=12)
    np.testing.assert_allclose(prompt_logits(ocl_engine, prompt), prompt_logits(torch_engine, prompt), atol=1e-3,
                               rtol=0)


@pytest.mark.slow
def test_fp16_weights_stay_close_to_fp32(loaded_model, cl_dev, ocl_engine, model_config):
    """fp16 storage (fp32 compute) is the opt-in speed setting; its logit error is bounded here."""
    half = make_engine(loaded_model, cl_dev, weights_dtype="fp16", max_context=256, kv_cache_mb=4)
    for seed in (14, 15):
        prompt = random_prompt(30, model_config.vocab_size, seed=seed)
        la, lb = prompt_logits(half, prompt), prompt_logits(ocl_engine, prompt)
        # measured here: max |diff| ~0.05-0.1 on logits of magnitude ~20
        assert np.abs(la - lb).max() < 0.5
        assert np.abs(la - lb).max() / np.abs(lb).max() < 0.02


def test_imported_kv_lands_where_torch_keeps_it(ocl_engine, torch_engine, model_config):
    """The hybrid hand-off's receiving side: what is imported into scattered blocks reads back as
    torch's own KV. (That it then decodes like torch is in tests/stack/test_engine_contract.py.)"""
    prompt = random_prompt(21, model_config.vocab_size, seed=17)
    _, kv = prefilled_kv(torch_engine, prompt)
    table = [5, 2]  # out of order, not from 0
    for layer in range(model_config.n_layers):
        ocl_engine.import_kv_blocks(table, layer, kv[layer])
    ocl_engine.finish_import_blocks()
    np.testing.assert_array_equal(ocl_engine.read_kv_blocks(table, len(prompt)), kv)


def test_no_matching_device_lists_what_is_present():
    import re

    import pyopencl as cl

    from services.decode_fpga.device import DeviceSelectionError, select_device

    present = cl.get_platforms()[0].name.strip()  # PoCL here; NVIDIA CUDA on a lent GPU machine
    with pytest.raises(DeviceSelectionError, match=f"present: .*{re.escape(present)}"):
        select_device(platform="Xilinx")
