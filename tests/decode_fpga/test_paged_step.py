"""The OpenCL engine's paged step (BatchEngine, services/engine/api.py) on the real model: batch
invariance bit for bit, an engine loop's and transformers' tokens, chunked prefill, KV import and
export through scattered blocks, and refusals of bad input."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from services.decode_fpga.one_launch_choice import OneLaunchChoice
from services.engine.scheduler import ScheduledChunk
from tests.conftest import random_prompt

N_NEW = 6  # tokens sampled per sequence (the prefill's and five decodes')


def chunk(seq_id: int, start: int, tokens, table, samples: bool = True) -> ScheduledChunk:
    return ScheduledChunk(seq_id, start, tuple(int(t) for t in tokens), tuple(int(b) for b in table), samples, None)


def scattered_tables(engine, lengths, seed):
    """Disjoint tables of random, non-monotonic block ids, each covering its length."""
    need = [-(-n // engine.block_size) for n in lengths]
    ids = np.random.default_rng(seed).permutation(engine.num_blocks)[:sum(need)].tolist()
    if len(ids) < sum(need):
        raise ValueError("the test's pool is too small")
    return [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lengths))]


def run_alone(engine, prompt, table, n_new=N_NEW):
    """One sequence, alone in every step: the prompt in one chunk, then one decode a step.
    Returns (tokens, logits [n_new, vocab])."""
    logits = [engine.step([chunk(0, 0, prompt, table)], greedy=False)[0]]
    tokens = [int(np.argmax(logits[-1]))]
    for i in range(n_new - 1):
        logits.append(engine.step([chunk(0, len(prompt) + i, [tokens[-1]], table)], greedy=False)[0])
        tokens.append(int(np.argmax(logits[-1])))
    return tokens, np.stack(logits)


def run_together(engine, prompts, tables, budget, greedy, n_new=N_NEW):
    """Every sequence in shared steps, as the scheduler would run them: each step the running
    decodes first, then prompts in chunks (never of one token) within `budget` tokens, one
    arriving every step. Returns per sequence (tokens, logits [n_new, vocab] or None)."""
    tokens = [[] for _ in prompts]
    logits = [[] for _ in prompts]
    done = [0] * len(prompts)  # prompt tokens computed
    arrived = 0
    while any(len(t) < n_new for t in tokens):
        arrived = min(arrived + 1, len(prompts))
        chunks, owners = [], []
        for i in range(arrived):  # decodes
            if done[i] == len(prompts[i]) and 0 < len(tokens[i]) < n_new:
                chunks.append(chunk(i, len(prompts[i]) + len(tokens[i]) - 1, [tokens[i][-1]], tables[i]))
                owners.append(i)
        left = budget - len(chunks)
        for i in range(arrived):  # prefill chunks
            rest = len(prompts[i]) - done[i]
            take = min(rest, left)
            if rest - take == 1:
                take -= 1
            if take < 2:
                continue
            samples = take == rest
            chunks.append(chunk(i, done[i], prompts[i][done[i]:done[i] + take], tables[i], samples))
            if samples:
                owners.append(i)
            done[i] += take
            left -= take
        out = engine.step(chunks, greedy=greedy)
        assert len(out) == len(owners)
        for i, o in zip(owners, out):
            if greedy:
                tokens[i].append(int(o))
            else:
                logits[i].append(o)
                tokens[i].append(int(np.argmax(o)))
    return [(t, np.stack(lg) if lg else None) for t, lg in zip(tokens, logits)]


PROMPT_LENGTHS = [5, 12, 28, 45, 60, 90, 121, 139]  # decode positions 15, 31, 47, 63, 143: where tiles end


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ["ocl_gguf_engine", "ocl_engine"])
def test_eight_prompts_alone_and_together_are_bit_identical(engine_name, request, model_config):
    engine = request.getfixturevalue(engine_name)
    prompts = [random_prompt(n, model_config.vocab_size, seed=40 + i) for i, n in enumerate(PROMPT_LENGTHS)]
    tables = scattered_tables(engine, [n + N_NEW for n in PROMPT_LENGTHS], seed=3)
    alone = [run_alone(engine, p, t) for p, t in zip(prompts, tables)]
    # the same blocks again, in shared steps: every position is rewritten before it is read
    together = run_together(engine, prompts, tables, budget=96, greedy=False)
    for i, ((ta, la), (tt, lt)) in enumerate(zip(alone, together)):
        assert ta == tt, f"prompt {i}"
        assert np.array_equal(la, lt), f"prompt {i}: logits differ by {np.abs(la - lt).max()}"
    greedy = run_together(engine, prompts, scattered_tables(engine, [n + N_NEW for n in PROMPT_LENGTHS], seed=4),
                          budget=64, greedy=True)
    assert [t for t, _ in greedy] == [t for t, _ in alone]  # the device's argmax, other blocks, other chunks


@pytest.mark.parametrize("n_prompt", [1, 17, 129])
def test_steps_over_scattered_blocks_give_an_engine_loops_tokens(ocl_gguf_engine, model_config, n_prompt):
    """The step called directly over a scattered table, and a request through an engine loop (its blocks
    from the loop's allocator, services/engine/one_request.py): the same tokens."""
    from services.engine.one_request import greedy_tokens

    e = ocl_gguf_engine
    prompt = random_prompt(n_prompt, model_config.vocab_size, seed=21)
    table = scattered_tables(e, [n_prompt + 12], seed=n_prompt)[0]
    out = e.step([chunk(7, 0, prompt, table)], greedy=True)
    for i in range(11):
        out += e.step([chunk(7, n_prompt + i, [out[-1]], table)], greedy=True)
    assert out == greedy_tokens(e, prompt, 12)


@pytest.mark.slow
def test_step_gives_transformers_tokens(ocl_gguf_engine, hf_model, model_config):
    from tests.conftest import hf_greedy

    e = ocl_gguf_engine
    prompts = [random_prompt(n, model_config.vocab_size, seed=11) for n in (17, 128)]
    tables = scattered_tables(e, [n + 16 for n in (17, 128)], seed=5)
    together = run_together(e, prompts, tables, budget=80, greedy=True, n_new=16)
    for p, (tokens, _) in zip(prompts, together):
        assert tokens == hf_greedy(hf_model, p, 16)


def test_chunked_prefill_of_300_tokens_equals_one_chunk(ocl_gguf_engine, model_config):
    e = ocl_gguf_engine
    prompt = random_prompt(300, model_config.vocab_size, seed=22)
    one, chunked = scattered_tables(e, [300, 300], seed=6)
    whole = e.step([chunk(0, 0, prompt, one)], greedy=False)[0]
    for start in range(0, 300, 64):
        part = prompt[start:start + 64]
        got = e.step([chunk(0, start, part, chunked, samples=start + len(part) == 300)], greedy=False)
    assert got.shape == (1, model_config.vocab_size)
    assert np.argmax(got[0]) == np.argmax(whole)
    np.testing.assert_array_equal(got[0], whole)  # every row computed as alone: the same bits
    np.testing.assert_array_equal(e.read_kv_blocks(chunked, 300), e.read_kv_blocks(one, 300))


@pytest.mark.parametrize("wire", [np.float32, np.float16])
def test_imported_kv_round_trips_through_scattered_blocks(ocl_gguf_engine, model_config, wire):
    e, c = ocl_gguf_engine, model_config
    n = 2 * e.block_size + 5
    table, other = scattered_tables(e, [n, 3 * e.block_size], seed=7)
    before = e.read_kv_blocks(other, 3 * e.block_size)
    kv = np.random.default_rng(8).standard_normal((c.n_layers, 2, c.n_kv_heads, n, c.head_dim)).astype(wire)
    for layer in range(c.n_layers):
        e.import_kv_blocks(table, layer, kv[layer])
    e.finish_import_blocks()
    np.testing.assert_array_equal(e.read_kv_blocks(table, n), kv.astype(np.float32))
    np.testing.assert_array_equal(e.read_kv_blocks(other, 3 * e.block_size), before)  # nothing else written


def test_imported_kv_decodes_as_the_kv_it_came_from(ocl_gguf_engine, model_config):
    """Hybrid in small: a prompt's KV read out of its blocks and imported into others decodes to the
    same logits, bit for bit."""
    e = ocl_gguf_engine
    prompt = random_prompt(40, model_config.vocab_size, seed=23)
    src, dst = scattered_tables(e, [48, 48], seed=9)
    first = int(np.argmax(e.step([chunk(0, 0, prompt, src)], greedy=False)[0]))
    kv = e.read_kv_blocks(src, 40)
    for layer in range(model_config.n_layers):
        e.import_kv_blocks(dst, layer, kv[layer])
    e.finish_import_blocks()
    a = e.step([chunk(0, 40, [first], src)], greedy=False)
    b = e.step([chunk(1, 40, [first], dst)], greedy=False)
    np.testing.assert_array_equal(a, b)


def test_a_hand_off_imports_beside_a_running_step(ocl_gguf_engine, model_config):
    """A hand-off's layers go in while a step holds the engine (under load a step takes up to 2 s, and
    each of 30 layers waiting for one made the exposed hand-off 2.5-10 s), and steps running on other
    blocks meanwhile give the bits they give alone."""
    e, c = ocl_gguf_engine, model_config
    n = e.block_size + 9
    table, busy = scattered_tables(e, [n, 48], seed=11)
    kv = np.random.default_rng(12).standard_normal((c.n_layers, 2, c.n_kv_heads, n, c.head_dim)).astype(np.float32)

    def hand_off():
        for layer in range(c.n_layers):
            e.import_kv_blocks(table, layer, kv[layer])
        e.finish_import_blocks()

    holding, release = threading.Event(), threading.Event()

    def a_step_in_progress():  # what step() holds while its launches run and it waits for them
        with e._lock:
            holding.set()
            release.wait(60)

    stepper, importer = threading.Thread(target=a_step_in_progress), threading.Thread(target=hand_off)
    stepper.start()
    try:
        assert holding.wait(10)
        importer.start()
        importer.join(20)
        assert not importer.is_alive(), "the import waited for the step holding the engine"
    finally:
        release.set()
        stepper.join()
        if importer.ident is not None:
            importer.join()
    np.testing.assert_array_equal(e.read_kv_blocks(table, n), kv)

    # real steps on other blocks while hand-offs import: the same logits as with nothing beside them
    prompt = random_prompt(40, c.vocab_size, seed=13)
    _, alone = run_alone(e, prompt, busy)
    got = {}
    stepping = threading.Thread(target=lambda: got.setdefault("beside", run_alone(e, prompt, busy)[1]))
    stepping.start()
    for _ in range(3):
        hand_off()
    stepping.join()
    np.testing.assert_array_equal(got["beside"], alone)
    np.testing.assert_array_equal(e.read_kv_blocks(table, n), kv)


def test_bad_steps_are_refused(ocl_gguf_engine, model_config):
    e = ocl_gguf_engine
    table = list(range(4))
    bad = {
        "at least one chunk": [],
        "at most 512": [chunk(0, 0, [5] * 513, list(range(33)))],
        "table holds 4": [chunk(0, 60, [5] * 5, table)],  # positions 60..64 need a fifth block
        "outside": [chunk(0, 0, [5], [e.num_blocks])],
        "two chunks": [chunk(0, 0, [5], table), chunk(0, 1, [6], table)],
        "vocabulary|outside \\[0": [chunk(0, 0, [model_config.vocab_size], table)],
        "positions: need": [chunk(0, e.max_context, [5], list(range(e.max_context // e.block_size + 1)))],
    }
    for match, chunks in bad.items():
        with pytest.raises(ValueError, match=match):
            e.step(chunks, greedy=True)
    with pytest.raises(ValueError, match="outside"):
        e.import_kv_blocks([-1], 0, np.zeros((2, model_config.n_kv_heads, 3, model_config.head_dim), np.float32))
    with pytest.raises(ValueError, match="table holds"):
        e.read_kv_blocks([0], e.block_size + 1)
    # and a good step still runs after the refusals
    assert len(e.step([chunk(0, 0, [5, 6, 7], table)], greedy=True)) == 1


def test_a_step_without_sampling_chunks_returns_nothing(ocl_gguf_engine):
    e = ocl_gguf_engine
    assert e.step([chunk(0, 0, [5, 6, 7], [1], samples=False)], greedy=True) == []
    assert e.step([chunk(0, 0, [5, 6, 7], [1], samples=False)], greedy=False).shape == (0, e.cfg.vocab_size)


def decode_logits(engine, prompt, table, n_new):
    """The prompt in one step, then n_new one-row decode steps: their logits [n_new, vocab]."""
    token = int(np.argmax(engine.step([chunk(0, 0, prompt, table)], greedy=False)[0]))
    out = []
    for i in range(n_new):
        out.append(engine.step([chunk(0, len(prompt) + i, [token], table)], greedy=False)[0])
        token = int(np.argmax(out[-1]))
    return np.stack(out)


# 1: a first decode over one cached position; 31: decodes cross position 31, where attention tiles end; 70: a
# prompt of several blocks
@pytest.mark.parametrize("n_prompt", [1, 9, 31, 70])
@pytest.mark.usefixtures("cpu_device")
def test_one_decode_row_runs_as_one_launch_bit_for_bit(ocl_gguf_engine, ocl_gguf_launches_engine, model_config,
                                                       n_prompt, monkeypatch):
    one, launches = ocl_gguf_engine, ocl_gguf_launches_engine
    assert one.paged_plans.one_launch is not None and launches.paged_plans.one_launch is None
    rows = one.step_inputs.rows([chunk(0, 0, [5], [0])])
    assert one.paged_plans.can_run_as_one_launch(rows)
    two = one.step_inputs.rows([chunk(0, 0, [5], [0]), chunk(1, 0, [6], [1])])  # several rows: their own launch
    assert one.paged_plans.one_launch_for(two) is one.paged_plans.one_launch_rows is not one.paged_plans.one_launch
    choice = OneLaunchChoice(fixed=True)  # no tries of the other way
    monkeypatch.setattr(one, "one_launch_choice", choice)
    prompt = random_prompt(n_prompt, model_config.vocab_size, seed=24)
    table = scattered_tables(one, [n_prompt + 8], seed=10)[0]
    np.testing.assert_array_equal(decode_logits(one, prompt, table, 6), decode_logits(launches, prompt, table, 6))
    # every one-row step ran as one launch, but for any that gave up on a busy machine (redone by launches):
    # the 6 decodes, and a prompt of one token too (a one-token chunk is a decode row)
    one_row_steps = 6 + (n_prompt == 1)
    assert choice.ran[True] >= 1 and choice.ran[True] + choice.gave_up == one_row_steps



def few_rows_logits(engine, prompts, tables):
    """Each prompt in a step of its own; then steps of 2-4 rows: the sequences' decodes together (positions
    crossing 15 and 31, where attention tiles end), a verify-like chunk of 4 tokens with every row's logits,
    a chunk of 3 beside a decode. Every step's logits, in order."""
    import dataclasses

    firsts = [int(np.argmax(engine.step([chunk(i, 0, p, t)], greedy=False)[0])) for i, (p, t) in
              enumerate(zip(prompts, tables))]
    pos, last, out = [len(p) for p in prompts], firsts, []
    for _ in range(8):  # every sequence decodes
        logits = engine.step([chunk(i, pos[i], [last[i]], tables[i]) for i in range(len(prompts))], greedy=False)
        out.append(logits)
        last = [int(np.argmax(lg)) for lg in logits]
        pos = [n + 1 for n in pos]
    drafts = [last[0], 17, 923 % engine.cfg.vocab_size, 4]  # sequence 0's newest token and three drafts
    out.append(engine.step([dataclasses.replace(chunk(0, pos[0], drafts, tables[0]), all_logits=True)],
                           greedy=False))
    out.append(engine.step([chunk(1, pos[1], [last[1]], tables[1]),
                            chunk(0, pos[0] + 4, [5, 6, 7], tables[0])], greedy=False))
    return out


@pytest.mark.parametrize("group_attention", [True, False], ids=["kv-head-items", "query-head-items"])
@pytest.mark.usefixtures("cpu_device")
def test_steps_of_few_rows_run_as_one_launch_bit_for_bit(ocl_gguf_engine, ocl_gguf_launches_engine, model_config,
                                                         monkeypatch, group_attention):
    """paged_rows_layers (2 to 4 rows in one launch) gives every row the launches' logits, bit for bit, with
    its attention a kv head's query heads at once (a CPU's, where the scores fit in local memory) or a query
    head at a time (elsewhere)."""
    one, launches = ocl_gguf_engine, ocl_gguf_launches_engine
    assert one.paged_plans.one_launch_rows is not None and launches.paged_plans.one_launch_rows is None
    assert one.paged.kernels.scores_fit(one.paged.max_blocks)  # PoCL: the kv-head items by default
    if not group_attention:
        monkeypatch.setattr(one.paged.kernels, "scores_fit", lambda max_blocks: False)
    # one work-group: its barriers never wait for another, so the one launch runs even beside busy processes
    # (with several, it may give up and be redone launch by launch); the rows each computes are the same
    monkeypatch.setattr(one.paged_plans, "one_launch_rows", one.paged_plans._bind_rows_launch(1))
    five = one.step_inputs.rows([chunk(0, 0, [5, 6, 7, 8, 9], [0])])
    assert not one.paged_plans.can_run_as_one_launch(five)  # past ONE_LAUNCH_ROWS
    choices = {n: OneLaunchChoice(fixed=True, rows=n) for n in (2, 3, 4)}  # no tries of the other way
    monkeypatch.setattr(one, "rows_launch_choices", choices)
    prompts = [random_prompt(n, model_config.vocab_size, seed=30 + n) for n in (9, 26, 3)]
    tables = scattered_tables(one, [n + 20 for n in (9, 26, 3)], seed=12)
    got, want = few_rows_logits(one, prompts, tables), few_rows_logits(launches, prompts, tables)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"step {i}")
    # every step of 2-4 rows ran as one launch: the 3-token prompt, 8 decode steps of 3 rows, the chunk of 4,
    # the chunk of 3 beside a decode
    assert sum(c.ran[True] for c in choices.values()) == 11 and not any(c.gave_up for c in choices.values())


@pytest.mark.usefixtures("cpu_device")
def test_no_several_row_launch_where_its_local_arrays_do_not_fit(ocl_gguf_engine, monkeypatch):
    """A device whose local memory cannot hold four rows of a GEMV's input and a kv head's scores gets no
    several-row launch (steps of 2-4 rows then run launch by launch); PoCL's 1 MiB holds them."""
    from types import SimpleNamespace

    plans = ocl_gguf_engine.paged_plans
    assert plans.one_launch_rows is not None
    small = SimpleNamespace(device=SimpleNamespace(local_mem_size=16 * 1024))  # the default model needs ~37 KiB
    monkeypatch.setattr(plans, "dev", small)
    assert plans._bind_rows_launch(1) is None


@pytest.mark.usefixtures("cpu_device")
def test_one_launch_that_cannot_run_falls_back_launch_by_launch(loaded_model, cl_dev, ocl_gguf_launches_engine,
                                                                model_config, caplog):
    """More work-groups than PoCL has threads: the barrier gives up, the step is redone launch by
    launch with the same results, and the engine turns to launch by launch."""
    import logging

    from prometheus_client import REGISTRY

    from services.model.gguf_blocks import read_block_tensors
    from tests.decode_fpga.conftest import make_engine

    engine = make_engine(loaded_model, cl_dev, weights_dtype="gguf", max_context=64, kv_cache_mb=4,
                         blocks=read_block_tensors(loaded_model.checkpoint, model_config))
    plans = engine.paged_plans
    plans.one_launch = plans._bind_one_launch(2 * cl_dev.device.max_compute_units + 1)
    prompt = random_prompt(9, model_config.vocab_size, seed=25)
    table = scattered_tables(engine, [20], seed=11)[0]
    gave_up_before = REGISTRY.get_sample_value("hybridserve_decode_one_launch_gave_up_total")
    with caplog.at_level(logging.WARNING, logger="services.decode_fpga.one_launch_choice"):
        got = decode_logits(engine, prompt, table, 7)
    assert REGISTRY.get_sample_value("hybridserve_decode_one_launch_gave_up_total") == gave_up_before + 4
    assert any("did not all run at once" in r.getMessage() for r in caplog.records)
    # the give-up, a try of launch by launch, three more give-ups beside it: launch by launch it is
    choice = engine.one_launch_choice
    assert choice.gave_up == 4 and choice.current is False and choice.ran == {True: 0, False: 7}
    np.testing.assert_array_equal(got, decode_logits(ocl_gguf_launches_engine, prompt, table, 7))
