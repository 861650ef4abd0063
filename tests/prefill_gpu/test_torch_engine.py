"""The PyTorch engine's logits against transformers', at prefill and decode steps.

What every engine must do (greedy tokens, batching, sampling, finish reasons, KV import)
is checked on both engines in tests/stack/test_engine_contract.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import random_prompt

ATOL = 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 17, 128, 512])
def test_logits_match_transformers_at_prefill_and_16_decode_steps(torch_engine, hf_model, model_config, n):
    prompt = random_prompt(n, model_config.vocab_size)
    seq = torch_engine.new_sequence(n + 16)
    ours = torch_engine.prefill(seq, prompt)
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
    np.testing.assert_allclose(ours, out.logits[0, -1].numpy(), atol=ATOL, rtol=0)
    past = out.past_key_values
    for _ in range(16):
        token = int(np.argmax(ours))
        ours = torch_engine.decode([seq], [token])[0]
        with torch.no_grad():
            out = hf_model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        np.testing.assert_allclose(ours, out.logits[0, -1].numpy(), atol=ATOL, rtol=0)
