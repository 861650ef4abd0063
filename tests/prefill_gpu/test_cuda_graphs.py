"""The torch engine's fixed-shape steps (services/prefill_gpu/cuda_graphs.py).

On the CPU the fixed-shape forward runs eagerly (no capture), so everything but the capture
itself is checked here on every machine: the device-side plan (slots from block tables, causal
mask, bias, padding rows into the scratch block) gives the planned eager step's logits and KV,
touches no slot outside the step's own and the scratch block, and a scheduler-driven run gives
the same tokens. On CUDA (`-m cuda`, a lent GPU) the same runs go through captured graphs.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from services.engine.batching_settings import BatchingSettings
from services.engine.sampling import SamplingParams
from services.prefill_gpu.batched_step import forward_logits, plan_step
from services.prefill_gpu.cuda_graphs import CHUNK, DECODE, StepGraphs
from tests.conftest import hf_greedy, random_prompt
from tests.prefill_gpu.test_batched_step import chunk, serve

BATCHING = BatchingSettings(kv_cache_mb=64, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def engine(loaded_model):
    from services.prefill_gpu.engine import TorchEngine

    eng = TorchEngine(loaded_model.config, loaded_model.weights, device="cpu", batching=BATCHING)
    assert eng.graphs is None  # the CPU engine runs eagerly unless a test attaches the fixed-shape steps
    return eng


def fixed_shape(engine) -> StepGraphs:
    return StepGraphs(engine.model, engine.kv_pool, engine.max_num_batched_tokens, engine.max_num_seqs,
                      engine.cfg.max_context, capture=False)


@pytest.fixture
def with_fixed_shape(engine):
    engine.graphs = fixed_shape(engine)
    yield engine.graphs
    engine.graphs = None


def test_scheduled_run_gives_the_eager_tokens_and_uses_both_kinds(engine, model_config, hf_model, with_fixed_shape):
    prompts = [random_prompt(n, model_config.vocab_size, seed=11) for n in (5, 40)]
    fixed = serve(engine, prompts, 6, budget=32, arrivals_per_step=1)
    assert with_fixed_shape.replays[DECODE] > 0 and with_fixed_shape.replays[CHUNK] > 0, with_fixed_shape.replays
    engine.graphs = None
    assert fixed == serve(engine, prompts, 6, budget=32, arrivals_per_step=1)
    assert fixed[1] == hf_greedy(hf_model, prompts[1], 6)


def _step_both_ways(engine, chunks):
    """(eager logits, fixed-shape logits, pool before, pool after eager, pool after fixed)."""
    pool = engine.kv_pool
    before = pool.data.clone()
    eager = forward_logits(engine.model, pool, plan_step(chunks, pool, engine.max_num_batched_tokens,
                                                         engine.cfg.vocab_size))
    after_eager = pool.data.clone()
    pool.data.copy_(before)
    graphs = fixed_shape(engine)
    bucket = graphs.bucket_for(chunks)
    assert bucket is not None
    from services.prefill_gpu.cuda_graphs import StaticStep

    static = StaticStep(engine.model, pool, bucket)
    static.fill(chunks)
    with torch.inference_mode():
        fixed = static.forward()
    return eager, fixed, before, after_eager, pool.data.clone()


def _outside(pool, data, keep_slots):
    """The pool's slots other than `keep_slots` and the scratch block, [layers, 2, kvh, n, dim]."""
    bs = pool.block_size
    mask = np.ones(data.shape[3], dtype=bool)
    mask[list(keep_slots)] = False
    mask[pool.scratch_block * bs:(pool.scratch_block + 1) * bs] = False
    return data[:, :, :, torch.from_numpy(mask)]


def test_decode_step_matches_the_planned_step_and_writes_only_its_slots(engine, model_config):
    vocab, bs = model_config.vocab_size, engine.block_size
    # three sequences in scattered blocks, prefilled for real first so attention reads real K/V
    tables = [(7, 2, 30), (11,), (4, 5, 6, 9)]
    lengths = [40, 9, 60]
    for i, (t, n) in enumerate(zip(tables, lengths)):
        engine.step([chunk(0, random_prompt(n, vocab, seed=i), t, seq_id=i)], greedy=True)
    decodes = [chunk(n, [100 + i], t, seq_id=i) for i, (t, n) in enumerate(zip(tables, lengths))]
    eager, fixed, before, after_eager, after_fixed = _step_both_ways(engine, decodes)
    assert fixed.shape[0] >= 3
    torch.testing.assert_close(fixed[:3], eager, rtol=0, atol=1e-5)
    assert torch.equal(fixed[:3].argmax(-1), eager.argmax(-1))
    written = {t[n // bs] * bs + n % bs for t, n in zip(tables, lengths)}
    pool = engine.kv_pool
    slots = sorted(written)
    torch.testing.assert_close(after_fixed[:, :, :, slots], after_eager[:, :, :, slots], rtol=0, atol=1e-6)
    assert torch.equal(_outside(pool, after_fixed, written), _outside(pool, before, written))


def test_chunk_step_with_cached_context_matches_the_planned_step(engine, model_config):
    vocab, bs = model_config.vocab_size, engine.block_size
    table = (3, 8, 12, 1, 13)
    prompt = random_prompt(70, vocab, seed=5)
    engine.step([chunk(0, prompt[:33], table)], greedy=True)  # positions 0..32 cached
    rest = chunk(33, prompt[33:], table)  # 37 rows, a bucket of 64: 27 padding rows into the scratch block
    eager, fixed, before, after_eager, after_fixed = _step_both_ways(engine, [rest])
    # 64 rows against 37 in each matmul: the same values to fp32 rounding (MKL blocks them differently)
    torch.testing.assert_close(fixed, eager, rtol=1e-5, atol=1e-4)
    assert torch.equal(fixed.argmax(-1), eager.argmax(-1))
    written = {table[p // bs] * bs + p % bs for p in range(33, 70)}
    slots = sorted(written)
    torch.testing.assert_close(after_fixed[:, :, :, slots], after_eager[:, :, :, slots], rtol=1e-5, atol=1e-5)
    assert torch.equal(_outside(engine.kv_pool, after_fixed, written), _outside(engine.kv_pool, before, written))


@pytest.mark.parametrize("kind", [DECODE, CHUNK])
def test_a_step_of_padding_only_writes_nothing_but_the_scratch_block(engine, kind):
    """What a capture runs (its inputs are padding): every slot outside the scratch block unchanged."""
    from services.prefill_gpu.cuda_graphs import Bucket, StaticStep

    pool = engine.kv_pool
    before = pool.data.clone()
    static = StaticStep(engine.model, pool, Bucket(kind, 16, 64))
    static.inputs.copy_(static.host)  # fill_padding's host buffer, as capture() copies it
    with torch.inference_mode():
        logits = static.forward()
    assert torch.isfinite(logits).all()
    assert torch.equal(_outside(pool, pool.data, ()), _outside(pool, before, ()))


def test_steps_without_a_bucket_run_eagerly(engine, model_config):
    graphs = fixed_shape(engine)
    mixed = [chunk(10, [1], (0,), seq_id=0), chunk(0, [1, 2, 3], (1,), seq_id=1)]
    assert graphs.bucket_for(mixed) is None
    too_many = [chunk(3, [1], (i,), seq_id=i) for i in range(graphs.max_decode_rows + 1)]
    assert graphs.bucket_for(too_many) is None
    assert graphs.bucket_for([chunk(0, [1] * 20, (0, 1))]).rows == 32
    # a chunk that wants every row's logits (a verify chunk's drafts, prompt logprobs): the graphs give a
    # chunk's last row only
    every_row = dataclasses.replace(chunk(16, [1, 2, 3, 4, 5], (0, 1)), all_logits=True, num_drafts=4)
    assert graphs.bucket_for([every_row]) is None


def test_drafts_through_the_fixed_shape_steps_give_the_tokens_without(engine, tokenizer, model_config,
                                                                      with_fixed_shape):
    """n-gram drafts with the fixed-shape steps attached (CUDA's path, run eagerly here): greedy tokens equal to
    those without drafts, in fewer steps. A lone verify chunk once took the prefill-chunk bucket, whose last
    row alone came back, and skipped tokens (seen on a lent H200 through the speculation benchmark)."""
    from tests.decode_fpga.test_speculative_decoding import copy_prompt, run

    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    prompt, eos = copy_prompt(tokenizer), model_config.eos_token_ids
    (off,), steps_off, _ = run(engine, eos, [(prompt, greedy)], k=0)
    (on,), steps_on, leaked = run(engine, eos, [(prompt, greedy)], k=4)
    assert on == off and steps_on < steps_off and leaked == 0, (on, off, steps_on, steps_off)
    assert with_fixed_shape.replays[DECODE] > 0  # the drafts-off run's decodes went through the fixed shape


def test_bad_input_raises_value_error_on_the_fixed_shape_path(engine, model_config, with_fixed_shape):
    vocab, n_blocks = model_config.vocab_size, engine.num_blocks
    with pytest.raises(ValueError, match="block ids"):
        engine.step([chunk(3, [1], (n_blocks,))], greedy=True)
    with pytest.raises(ValueError, match="block ids"):  # the scratch block is no sequence's
        engine.step([chunk(0, [1, 2], (engine.kv_pool.scratch_block,))], greedy=True)
    with pytest.raises(ValueError, match="token ids"):
        engine.step([chunk(3, [vocab], (0,))], greedy=True)
    with pytest.raises(ValueError, match="past the block table"):
        engine.step([chunk(16, [1], (0,))], greedy=True)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.step([chunk(0, [1] * 513, tuple(range(33)))], greedy=True)
    assert with_fixed_shape.replays == {DECODE: 0, CHUNK: 0}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_give_the_eager_tokens_on_cuda(loaded_model, model_config):
    from services.prefill_gpu.engine import TorchEngine

    eng = TorchEngine(loaded_model.config, loaded_model.weights, device="cuda", batching=BATCHING)
    prompts = [random_prompt(n, model_config.vocab_size, seed=3) for n in (5, 40, 90, 200)]
    graphs = eng.graphs
    captured = serve(eng, prompts, 12, budget=64, arrivals_per_step=1)
    assert graphs.replays[DECODE] > 0 and graphs.replays[CHUNK] > 0
    assert all(s.graph is not None for s in graphs.steps.values())
    eng.graphs = None
    assert captured == serve(eng, prompts, 12, budget=64, arrivals_per_step=1)


def test_a_lone_decode_in_a_one_row_bucket_with_the_cuda_defaults_gives_the_eager_tokens(loaded_model, model_config,
                                                                                         engine):
    """CUDA's configuration run on the CPU: fused kernels, [out, in] matrices and a one-row decode bucket
    (no padding rows: min_gemm_rows is 1 on CUDA) against the default engine's planned eager step."""
    from services.prefill_gpu.cuda_graphs import Bucket, StaticStep
    from services.prefill_gpu.engine import TorchEngine

    cuda_like = TorchEngine(loaded_model.config, loaded_model.weights, device="cpu", batching=BATCHING,
                            fused_ops="on", weight_layout="out_in")
    assert cuda_like.model.fused and cuda_like.model.out_in
    table, n = (6, 2, 9), 45
    prompt = random_prompt(n, model_config.vocab_size, seed=8)
    for eng in (engine, cuda_like):
        eng.step([chunk(0, prompt, table)], greedy=True)
    decode = [chunk(n, [321], table)]
    eager = forward_logits(engine.model, engine.kv_pool, plan_step(decode, engine.kv_pool,
                                                                   engine.max_num_batched_tokens, model_config.vocab_size))
    static = StaticStep(cuda_like.model, cuda_like.kv_pool, Bucket(DECODE, 1, 64))
    static.fill(decode)
    with torch.inference_mode():
        fixed = static.forward()
    assert fixed.shape == eager.shape == (1, model_config.vocab_size)
    torch.testing.assert_close(fixed, eager, rtol=0, atol=2e-4)  # fused sums: the same logits to rounding
    assert torch.equal(fixed.argmax(-1), eager.argmax(-1))
    slot = table[n // engine.block_size] * engine.block_size + n % engine.block_size
    torch.testing.assert_close(cuda_like.kv_pool.data[:, :, :, slot], engine.kv_pool.data[:, :, :, slot],
                               rtol=0, atol=1e-4)


def test_drafts_on_cuda_are_called_out_at_start():
    """prefill_gpu warns at start when drafts are asked for on CUDA, where its verify steps run eagerly and were
    measured slower than no drafts; nothing is said on the CPU or with drafts off."""
    from services.prefill_gpu.runtime import speculation_caveat

    assert "eagerly" in speculation_caveat("cuda", 3) and "SPECULATIVE_K=0" in speculation_caveat("cuda", 3)
    assert speculation_caveat("cuda", 0) is None and speculation_caveat("cpu", 3) is None


def test_prompt_logprobs_through_the_fixed_shape_steps_give_every_row(engine, with_fixed_shape):
    """A lone prompt chunk that wants every row's logits (prompt logprobs) gets them all, as eagerly; the
    prefill-chunk graph once gave its last row alone."""
    wants_all = dataclasses.replace(chunk(0, [5, 6, 7, 8, 9, 10], (0,)), all_logits=True)
    got = engine.step([wants_all], greedy=False)
    engine.graphs = None
    np.testing.assert_array_equal(got, engine.step([wants_all], greedy=False))
    assert got.shape[0] == 6
