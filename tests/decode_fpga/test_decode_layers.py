"""Every layer of a one-sequence decode step in one launch (decode_layers.cl), on PoCL's CPU device:
the same bits as the launch-by-launch step, one copy of the weights, and a clean way back when
its work-groups cannot all run at once."""
from __future__ import annotations

import logging
import numpy as np
import pyopencl as cl
import pytest

from services.decode_fpga.one_launch_choice import OneLaunchChoice
from services.decode_fpga.plans import StepKind
from tests.decode_fpga.conftest import make_engine


def steps(engine, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """n greedy steps after prompt, and the logits of one more (decode, not decode_greedy)."""
    seq = engine.new_sequence(len(prompt) + n + 1)
    try:
        tokens = [int(np.argmax(engine.prefill(seq, prompt)))]
        for _ in range(n):
            tokens += engine.decode_greedy([seq], [tokens[-1]])
        return tokens, engine.decode([seq], [tokens[-1]])[0]
    finally:
        engine.release(seq)


def test_the_one_row_plan_is_one_launch(ocl_gguf_engine):
    plan = ocl_gguf_engine.plans.decode_step(1)
    assert plan.kind is StepKind.ONE_LAUNCH
    assert [[la.kernel.function_name for la in layer] for layer in plan.layers] == [["clear_ints", "decode_layers"]]
    launch = plan.layers[0][1]
    assert launch.global_size == (ocl_gguf_engine.dev.device.max_compute_units,) and launch.local_size == (1,)
    # batches keep the launches of each layer
    batch = ocl_gguf_engine.plans.decode_step(2)
    assert batch.kind is StepKind.LAUNCH_BY_LAUNCH and len(batch.layers) == ocl_gguf_engine.cfg.n_layers


@pytest.mark.parametrize("n_prompt", [1, 70])
def test_bit_for_bit_the_launch_by_launch_step(ocl_gguf_engine, ocl_gguf_launches_engine, model_config, n_prompt,
                                               monkeypatch):
    from tests.conftest import random_prompt

    choice = OneLaunchChoice(fixed=True)  # no tries of the other way
    monkeypatch.setattr(ocl_gguf_engine, "one_launch_choice", choice)
    prompt = random_prompt(n_prompt, model_config.vocab_size, seed=21)
    tokens, logits = steps(ocl_gguf_engine, prompt, 24)
    ref_tokens, ref_logits = steps(ocl_gguf_launches_engine, prompt, 24)
    assert tokens == ref_tokens
    np.testing.assert_array_equal(logits, ref_logits)
    # the 25 steps ran as one launch, but for any that gave up on a busy machine (redone by launches)
    assert choice.ran[True] >= 1 and choice.ran[True] + choice.gave_up == 25


def test_weights_are_on_the_device_once(ocl_gguf_engine):
    """The layer matrices the launch-by-launch kernels read are sub-buffers of the packed buffer."""
    eng = ocl_gguf_engine
    packed, layers = eng.weights.packed.arrays, eng.weights.layers
    layer_bytes = sum(m.nbytes for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    norms = 2 * eng.cfg.n_layers * eng.cfg.hidden * 4
    assert layer_bytes + norms <= packed.nbytes < 1.05 * (layer_bytes + norms)
    d, m, q = layers[3].qkv.device_arrays
    assert d.int_ptr != q.int_ptr
    assert all(b.get_info(cl.mem_info.ASSOCIATED_MEMOBJECT) == packed.buffer for b in (d, m, q))


def test_work_groups_that_cannot_all_run_fall_back_launch_by_launch(loaded_model, cl_dev, ocl_gguf_launches_engine,
                                                                     model_config, caplog):
    """More work-groups than PoCL has threads: the first barrier waits in vain, gives up, and the engine
    redoes the step launch by launch, with the right tokens, and turns to launch by launch."""
    from services.model.gguf_blocks import read_block_tensors
    from tests.conftest import random_prompt

    engine = make_engine(loaded_model, cl_dev, weights_dtype="gguf", max_context=64, max_sequences=1,
                         blocks=read_block_tensors(loaded_model.checkpoint, model_config))
    engine.plans.layer_groups = 2 * cl_dev.device.max_compute_units + 1
    prompt = random_prompt(9, model_config.vocab_size, seed=22)
    with caplog.at_level(logging.WARNING, logger="services.decode_fpga.one_launch_choice"):
        tokens, logits = steps(engine, prompt, 6)
    assert any("did not all run at once" in r.getMessage() for r in caplog.records)
    # the give-up, a try of launch by launch (3 steps), three more give-ups beside it: launch by launch it is
    choice = engine.one_launch_choice
    assert choice.gave_up == 4 and choice.current is False and choice.ran == {True: 0, False: 7}
    assert engine.plans.decode_step(1, one_launch=False).kind is StepKind.LAUNCH_BY_LAUNCH
    ref_tokens, ref_logits = steps(ocl_gguf_launches_engine, prompt, 6)
    assert tokens == ref_tokens
    np.testing.assert_array_equal(logits, ref_logits)


def test_setting(monkeypatch):
    from services.decode_fpga.settings import DecodeSettings

    assert DecodeSettings().opencl_layer_kernels is True
    monkeypatch.setenv("HYBRIDSERVE_OPENCL_LAYER_KERNELS", "false")
    assert DecodeSettings().opencl_layer_kernels is False
