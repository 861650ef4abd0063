"""The PyTorch engine's logits against transformers', at a prompt's paged step and the decode steps after it.

What every engine must do (greedy tokens, batching, sampling, finish reasons, KV import)
is checked on both engines in tests/stack/test_engine_contract.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import random_prompt
from tests.engine.step_calls import StepSequence

ATOL = 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 17, 128, 512])
def test_logits_match_transformers_at_prefill_and_16_decode_steps(torch_engine, hf_model, model_config, n):
    prompt = random_prompt(n, model_config.vocab_size)
    seq = StepSequence(torch_engine, n + 16)
    ours = seq.prefill(prompt)
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
    np.testing.assert_allclose(ours, out.logits[0, -1].numpy(), atol=ATOL, rtol=0)
    past = out.past_key_values
    for _ in range(16):
        token = int(np.argmax(ours))
        ours = seq.decode(token)
        with torch.no_grad():
            out = hf_model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        np.testing.assert_allclose(ours, out.logits[0, -1].numpy(), atol=ATOL, rtol=0)


def test_the_cuda_configuration_on_the_cpu_keeps_transformers_logits_and_greedy_tokens(loaded_model, hf_model,
                                                                                        model_config):
    """Fused RMSNorm, residual adds in the GEMMs and [out, in] matrices (what CUDA runs by default):
    other sums than transformers', so its logits to rounding, and its greedy tokens exactly."""
    from services.prefill_gpu.engine import TorchEngine

    eng = TorchEngine(loaded_model.config, loaded_model.weights, device="cpu", fused_ops="on", weight_layout="out_in")
    assert eng.model.fused and eng.model.out_in
    prompt = random_prompt(60, model_config.vocab_size, seed=4)
    seq = StepSequence(eng, 60 + 12)
    ours = seq.prefill(prompt)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        np.testing.assert_allclose(ours, hf_model(ids).logits[0, -1].numpy(), atol=ATOL, rtol=0)
        theirs = hf_model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 60:].tolist()
    tokens = []
    for _ in range(12):
        tokens.append(int(np.argmax(ours)))
        ours = seq.decode(tokens[-1])
    assert tokens == theirs


def test_fused_ops_and_weight_layout_are_picked_by_device_and_checked():
    from services.prefill_gpu.engine import pick_fused, pick_layout
    from services.prefill_gpu.settings import PrefillSettings

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (pick_fused("auto", cpu), pick_fused("auto", cuda)) == (False, True)
    assert (pick_fused("on", cpu), pick_fused("off", cuda)) == (True, False)
    assert (pick_layout("auto", cpu), pick_layout("auto", cuda)) == ("in_out", "out_in")
    assert pick_layout("out_in", cpu) == "out_in"
    with pytest.raises(ValueError, match="fused_ops"):
        pick_fused("yes", cpu)
    with pytest.raises(ValueError, match="weight_layout"):
        pick_layout("row_major", cuda)
    env = {"HYBRIDSERVE_PREFILL_FUSED_OPS": "off", "HYBRIDSERVE_PREFILL_WEIGHT_LAYOUT": "in_out"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        s = PrefillSettings()
    assert (s.fused_ops, s.weight_layout) == ("off", "in_out")
