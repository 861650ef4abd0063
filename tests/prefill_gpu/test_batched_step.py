"""The torch engine's batched step over its paged KV pool (BatchEngine in services/engine/api.py).

Driven by the real scheduler (services/engine/scheduler.py) where a test needs continuous
batching, and by hand-built chunks where it needs exact block ids. The reference is transformers
(its tokens and its KV cache).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.batching_settings import BatchingSettings
from services.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, Sequence
from services.prefill_gpu.batched_step import MIN_GEMM_ROWS
from tests.conftest import hf_greedy, random_prompt

PROMPT_LENGTHS = (5, 17, 33, 64, 100, 130, 7, 250)
N_NEW = 10


@pytest.fixture(scope="module")
def engine(loaded_model):
    from services.prefill_gpu.engine import TorchEngine

    return TorchEngine(loaded_model.config, loaded_model.weights, device="cpu",
                       batching=BatchingSettings(kv_cache_mb=64, max_num_batched_tokens=512))


@pytest.fixture(scope="module")
def prompts(model_config):
    return [random_prompt(n, model_config.vocab_size, seed=7) for n in PROMPT_LENGTHS]


def serve(engine, prompts, n_new, budget, arrivals_per_step=None) -> list[list[int]]:
    """Greedy tokens of each prompt through the real scheduler and engine.step; EOS ignored.

    arrivals_per_step: add this many prompts before each step (None: all at once), so later
    prompts are prefilled in chunks while the earlier ones decode."""
    sched = Scheduler(SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size, max_num_seqs=8,
                                      max_num_batched_tokens=budget, enable_prefix_caching=False))
    seqs = [Sequence(i, p, n_new) for i, p in enumerate(prompts)]
    pending = list(seqs)
    while pending or sched.has_unfinished():
        take = len(pending) if arrivals_per_step is None else arrivals_per_step
        for seq in pending[:take]:
            sched.add(seq)
        pending = pending[take:]
        batch = sched.schedule()
        sampling = [c.seq_id for c in batch.chunks if c.samples]
        tokens = engine.step(batch.chunks, greedy=True) if not batch.is_empty else []
        sched.update(batch, dict(zip(sampling, tokens)))
    if sched.block_manager.num_free_blocks != engine.num_blocks:
        raise AssertionError("the scheduler kept blocks after every sequence finished")
    return [s.output_token_ids for s in seqs]


def chunk(start, tokens, table, samples=True, seq_id=0) -> ScheduledChunk:
    return ScheduledChunk(seq_id, start, tuple(tokens), tuple(table), samples, None)


def test_cpu_matmul_row_bits_do_not_depend_on_row_count(engine):
    """The property batched_step's batch invariance rests on: from the engine's row floor up (measured
    at its start, cpu_matmul.py), a row of each of the model's products has the same bits whatever
    the row count and the other rows; checked here at row counts the engine's check did not try."""
    floor = engine.min_gemm_rows
    assert 1 <= floor <= MIN_GEMM_ROWS
    gen = torch.Generator().manual_seed(0)
    products, _ = engine.model.row_products()
    for product, k in products:
        x = torch.randn(300, k, generator=gen)
        base = product(x[:floor])
        for m in (floor + 2, 7, 33, 100, 200, 300):
            assert torch.equal(product(x[:m])[:floor], base), f"rows changed bits at M={m}, K {k}"
        moved = torch.cat([x[100:137], x[:1]])  # row 0 last, among other rows
        assert torch.equal(product(moved)[-1], base[0])


def test_eight_prompts_alone_and_together_token_identical_and_equal_to_transformers(engine, prompts, hf_model):
    alone = [serve(engine, [p], N_NEW, budget=64)[0] for p in prompts]
    # two arrivals a step and a 64-token budget: decodes share steps with other prompts' prefill chunks
    together = serve(engine, prompts, N_NEW, budget=64, arrivals_per_step=2)
    assert together == alone
    assert serve(engine, prompts, N_NEW, budget=512) == alone
    assert alone == [hf_greedy(hf_model, p, N_NEW) for p in prompts]


def test_decode_logits_bit_identical_whatever_else_is_in_the_step(engine, prompts):
    """Stronger than equal tokens: a decode row's logits have the same bits alone and batched."""
    bs, tables, contexts = engine.block_size, [], []
    free = iter(range(engine.num_blocks))
    for p in prompts[:4]:
        table = [next(free) for _ in range(-(-(len(p) + 1) // bs))]
        engine.step([chunk(0, p, table)], greedy=True)
        tables.append(table)
        contexts.append(p)
    decodes = [chunk(len(p), [p[-1]], t, seq_id=i) for i, (p, t) in enumerate(zip(contexts, tables))]
    alone = [engine.step([d], greedy=False)[0] for d in decodes]
    prefill = chunk(0, prompts[5][:40], [next(free) for _ in range(40 // bs + 1)], samples=False, seq_id=9)
    together = engine.step(decodes + [prefill], greedy=False)
    assert together.dtype == np.float32 and together.shape == (4, engine.cfg.vocab_size)
    for row, ref in zip(together, alone):
        np.testing.assert_array_equal(row, ref)


def test_scattered_blocks_hold_transformers_kv_and_next_token(engine, model_config, hf_model):
    prompt = random_prompt(75, model_config.vocab_size, seed=3)
    table = np.random.default_rng(0).permutation(engine.num_blocks)[:5].tolist()  # 80 slots, out of order
    token = engine.step([chunk(0, prompt, table)], greedy=True)
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
    assert token == [int(out.logits[0, -1].argmax())]
    kv = engine.read_kv_blocks(table, len(prompt))  # [layers, 2, kvh, n, dim]
    for li, cached in enumerate(out.past_key_values.layers):  # K after RoPE, and V: [1, kvh, n, dim]
        np.testing.assert_allclose(kv[li, 0], cached.keys[0].numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(kv[li, 1], cached.values[0].numpy(), atol=1e-4, rtol=0)


def test_300_token_prompt_in_chunks_of_64_gives_the_one_chunk_token(engine, model_config):
    prompt = random_prompt(300, model_config.vocab_size, seed=5)
    n_blocks = -(-300 // engine.block_size)
    one_table, chunked_table = list(range(n_blocks)), list(range(n_blocks, 2 * n_blocks))
    whole = engine.step([chunk(0, prompt, one_table)], greedy=True)
    layers_seen = []
    for start in range(0, 300, 64):
        part = prompt[start:start + 64]
        last = engine.step([chunk(start, part, chunked_table, samples=start + 64 >= 300)], greedy=True,
                           on_layer=layers_seen.append)
    assert last == whole
    assert layers_seen == list(range(model_config.n_layers)) * 5
    np.testing.assert_allclose(engine.read_kv_blocks(chunked_table, 300), engine.read_kv_blocks(one_table, 300),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("wire", [np.float32, np.float16])
def test_import_read_export_round_trip(engine, model_config, wire):
    c = model_config
    n = 37
    table = [11, 3, 40]  # 48 slots, out of order
    rng = np.random.default_rng(1)
    layers = rng.standard_normal((c.n_layers, 2, c.n_kv_heads, n, c.head_dim)).astype(wire)
    for layer in range(c.n_layers):
        engine.import_kv_blocks(table, layer, layers[layer])
    engine.finish_import_blocks()
    back = engine.read_kv_blocks(table, n)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, layers.astype(np.float32))
    exported = engine.export_kv_blocks(table, 5, n)
    assert exported.device == engine.device and exported.dtype == engine.kv_dtype
    np.testing.assert_array_equal(exported.numpy(), layers[5].astype(np.float32))


def test_imported_kv_decodes_like_computed_kv(engine, model_config):
    """The hybrid hand-off: KV exported from one table and imported into another decodes the same."""
    prompt = random_prompt(50, model_config.vocab_size, seed=8)
    src, dst = [60, 61, 62, 63], [70, 2, 65, 4]
    first = engine.step([chunk(0, prompt, src)], greedy=True)[0]
    for layer in range(model_config.n_layers):
        engine.import_kv_blocks(dst, layer, engine.export_kv_blocks(src, layer, 50).numpy())
    engine.finish_import_blocks()
    a = engine.step([chunk(50, [first], src)], greedy=False)
    b = engine.step([chunk(50, [first], dst)], greedy=False)
    np.testing.assert_array_equal(a, b)


def test_bad_input_raises_value_error(engine, model_config):
    bs, nb = engine.block_size, engine.num_blocks
    cases = {
        "rows past max_num_batched_tokens": [chunk(0, [1] * 513, list(range(33)))],
        "position past the table": [chunk(0, [1] * (bs + 1), [0])],
        "decode past the table": [chunk(2 * bs, [1], [0, 1])],
        "negative block id": [chunk(0, [1, 2], [-1])],
        "block id past the pool": [chunk(0, [1, 2], [nb])],
        "token id outside the vocab": [chunk(0, [model_config.vocab_size], [0])],
        "empty chunk": [chunk(0, [], [0])],
    }
    for what, chunks in cases.items():
        with pytest.raises(ValueError):
            engine.step(chunks, greedy=True)
            pytest.fail(what)
    kv = np.zeros((2, model_config.n_kv_heads, 4, model_config.head_dim), np.float32)
    with pytest.raises(ValueError):
        engine.import_kv_blocks([0], model_config.n_layers, kv)  # no such layer
    with pytest.raises(ValueError):
        engine.import_kv_blocks([nb], 0, kv)
    with pytest.raises(ValueError):
        engine.import_kv_blocks([0], 0, kv[:, :1])  # wrong head count
    with pytest.raises(ValueError):
        engine.read_kv_blocks([0], bs + 1)


def test_pool_is_sized_from_the_budget(engine, model_config):
    c = model_config
    bytes_per_block = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4 * engine.block_size
    assert engine.num_blocks == (64 << 20) // bytes_per_block
    # and one scratch block no sequence gets, for the padding rows of fixed-shape (CUDA graph) steps
    assert engine.kv_pool.nbytes == (engine.num_blocks + 1) * bytes_per_block
    assert engine.kv_pool.scratch_block == engine.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("n_prompt", [17, 300])
def test_chunked_greedy_equals_transformers(engine, hf_model, model_config, n_prompt):
    prompt = random_prompt(n_prompt, model_config.vocab_size, seed=11)
    assert serve(engine, [prompt], 16, budget=64) == [hf_greedy(hf_model, prompt, 16)]


@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_layer_exporter_ships_a_paged_sequence_on_layer(engine, model_config, wire):
    """The hybrid hand-off from the pool: each layer goes into the sender from the step's on_layer."""
    from services.kv.header import SlotHeader
    from services.kv.inprocess import InProcessLink, InProcessSender
    from services.prefill_gpu.kv_export import LayerExporter

    c = model_config
    prompt = random_prompt(45, c.vocab_size, seed=9)
    table = [50, 7, 33]
    sender = InProcessSender(InProcessLink(), SlotHeader(wire, c.n_layers, c.n_kv_heads, c.head_dim, 45, c.model_id))
    sender.open()
    exporter = LayerExporter(engine, sender)
    ready = []
    engine.step([chunk(0, prompt, table)], greedy=True,
                on_layer=lambda layer: (exporter.write_layer(layer, table, 45), ready.append(exporter.wait_layer(layer))))
    assert [r.layer for r in ready] == list(range(c.n_layers))
    kv = engine.read_kv_blocks(table, 45)
    for layer in (0, c.n_layers - 1):
        np.testing.assert_array_equal(sender.layer_buffer(layer), kv[layer].astype(sender.layer_buffer(layer).dtype))
    sender.close()
