"""The engine loop over a pure-Python paged engine (paged_fake.py): streams, batching, cancellation,
preemption, prefix reuse, hybrid reservations, a failing step. The real engines run the same loop
in tests/stack/test_engine_runtime.py and, through the whole stack, tests/gateway/test_batching_live.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from services.engine.engine_loop import EngineLoop
from services.errors import Cancelled, EngineStepFailed, InvalidRequest, PromptTooLong, QueueFull
from services.engine.sampling import SamplingParams
from services.engine.scheduler import SchedulerConfig
from tests.engine.paged_fake import VOCAB, PagedFakeEngine, reference

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make_loop(num_blocks: int = 64, budget: int = 16, max_num_seqs: int = 8, max_waiting: int = 64, **kw):
    engine = PagedFakeEngine(num_blocks, block_size=4, max_num_batched_tokens=budget)
    config = SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=budget, max_model_len=128, **kw)
    return engine, EngineLoop(engine, config, max_waiting=max_waiting)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(3, 30))).tolist() for _ in range(n)]


def run(loop: EngineLoop, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], str]:
    tokens, reason = [], None
    for ev in loop.submit(prompt, params):
        tokens.append(ev.token)
        reason = ev.finish_reason
    return tokens, reason


def run_together(loop: EngineLoop, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    results: list = [None] * len(batch)

    def one(i):
        results[i] = run(loop, batch[i], params)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


@pytest.fixture
def loop_factory():
    loops = []

    def make(**kw):
        engine, loop = make_loop(**kw)
        loops.append(loop)
        return engine, loop
    yield make
    for loop in loops:
        loop.close()
        assert not loop._thread.is_alive()


def test_every_request_gets_the_reference_tokens_alone_and_together(loop_factory):
    engine, loop = loop_factory()
    batch = prompts(8)
    alone = [run(loop, p)[0] for p in batch]
    together = run_together(loop, batch)
    assert alone == together == [reference(p, 12) for p in batch]
    assert max(len(step) for step in engine.steps) > 1  # they did share steps
    assert loop.scheduler.block_manager.usage == 0.0


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_decodes(loop_factory):
    engine, loop = loop_factory(budget=16)
    short, long_prompt = prompts(1)[0], list(range(60))
    started = threading.Event()
    result: dict = {}

    def decode_short():
        stream = loop.submit(short, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        tokens = []
        for ev in stream:
            tokens.append(ev.token)
            if len(tokens) == 2:
                started.set()
        result["short"] = tokens

    t = threading.Thread(target=decode_short)
    t.start()
    started.wait(10)
    assert run(loop, long_prompt)[0] == reference(long_prompt, 12)
    t.join(10)
    assert result["short"] == reference(short, 40)
    long_id = max(sid for step in engine.steps for sid, _, _ in step)
    chunks = [(start, n) for step in engine.steps for sid, start, n in step if sid == long_id and n > 1]
    assert len(chunks) >= 4 and all(n <= 15 for _, n in chunks)  # 16 minus the running decode
    # every step that prefilled the long prompt also carried the short request's decode
    assert all(len(step) >= 2 for step in engine.steps if any(s == long_id and n > 1 for s, _, n in step))


def test_preemption_under_a_small_pool_still_gives_the_reference_tokens(loop_factory):
    _, loop = loop_factory(num_blocks=12, budget=32)
    batch = prompts(6, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert run_together(loop, batch, params) == [reference(p, 16) for p in batch]
    assert loop.scheduler.num_preemptions > 0
    assert loop.scheduler.block_manager.usage == 0.0


def test_a_cached_prefix_is_reused_and_gives_the_same_tokens(loop_factory):
    engine, loop = loop_factory()
    system = list(range(1, 33))
    first = run(loop, system + [40, 41])[0]
    steps_before = len(engine.steps)
    second = run(loop, system + [50, 51, 52])[0]
    assert first == reference(system + [40, 41], 12) and second == reference(system + [50, 51, 52], 12)
    # the second prompt's first chunk starts after the cached blocks
    starts = [start for step in engine.steps[steps_before:] for _, start, n in step if n > 1]
    assert starts[0] == 32
    assert loop.scheduler.block_manager.num_hit_tokens == 32


def test_cancelling_a_stream_frees_its_blocks_and_the_others_go_on(loop_factory):
    _, loop = loop_factory()
    a, b = prompts(2, seed=5)
    long_params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    stream = loop.submit(a, long_params)
    events = stream.events()
    next(events), next(events)
    events.close()  # the client went away
    assert run(loop, b)[0] == reference(b, 12)
    assert loop.num_unfinished == 0 and loop.scheduler.block_manager.usage == 0.0


def test_a_cancelled_waiting_request_leaves_the_queue(loop_factory):
    _, loop = loop_factory(num_blocks=16, max_num_seqs=1)
    a, b = prompts(2, seed=6)
    first = loop.submit(a, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    waiting = loop.submit(b, GREEDY)
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(Cancelled):
        list(waiting.events(cancelled=cancelled.is_set))
    assert [ev.token for ev in first] == reference(a, 20)
    assert loop.num_unfinished == 0 and loop.scheduler.num_waiting == 0


def test_bad_requests_fail_before_they_queue(loop_factory):
    _, loop = loop_factory(max_waiting=1, num_blocks=16)
    with pytest.raises(InvalidRequest):
        loop.submit([], GREEDY)
    with pytest.raises(InvalidRequest):
        loop.submit([VOCAB + 1], GREEDY)
    with pytest.raises(PromptTooLong):
        loop.submit(list(range(128)), GREEDY)
    with pytest.raises(PromptTooLong):  # more KV than the whole pool holds: refused by the loop
        list(loop.submit([1, 2, 3], SamplingParams(max_tokens=500, temperature=0.0)))


def test_more_requests_than_the_batch_and_the_queue_hold_are_refused(loop_factory):
    _, loop = loop_factory(max_num_seqs=2, max_waiting=1)
    streams = [loop.submit([1, 2], GREEDY), loop.submit([3, 4], GREEDY), loop.submit([5, 6], GREEDY)]
    with pytest.raises(QueueFull):
        loop.submit([7, 8], GREEDY)
    streams[0].cancel()  # a place comes back once a request ends
    for s in streams[1:]:
        assert len(list(s)) == 12
    assert len(list(loop.submit([7, 8], GREEDY))) == 12


def test_a_failed_step_fails_its_requests_and_the_loop_serves_on(loop_factory):
    engine, loop = loop_factory()
    engine.fail_next.set()
    with pytest.raises(EngineStepFailed):
        run(loop, [1, 2, 3])
    assert run(loop, [4, 5, 6])[0] == reference([4, 5, 6], 12)
    assert loop.scheduler.block_manager.usage == 0.0


def test_sampled_requests_use_the_logits_path(loop_factory):
    _, loop = loop_factory()
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True)
    assert run(loop, [7, 8, 9], params)[0] == reference([7, 8, 9], 8)  # the fake's logits leave one choice


def test_a_hybrid_request_decodes_from_imported_kv(loop_factory):
    engine, loop = loop_factory()
    prompt = prompts(1, seed=9)[0]
    stream = loop.reserve_remote(prompt, GREEDY)
    table = stream.wait_reserved(lambda: False)
    engine.import_kv_blocks(table, 0, np.asarray(prompt))  # the fake keeps the token ids as its "KV"
    engine.finish_import_blocks()
    first = reference(prompt, 1)[0]
    loop.activate_remote(stream, first)
    assert [ev.token for ev in stream] == reference(prompt, 12)
    assert loop.scheduler.block_manager.usage == 0.0


def test_a_prompt_export_sees_every_layer_of_the_whole_prompt(loop_factory):
    engine, loop = loop_factory(budget=16)
    prompt = list(range(3, 40))
    seen = []

    def export(layer, table, n):
        seen.append((layer, n))
        assert engine.tokens_at(table, n) == prompt  # every chunk's KV is in the blocks

    tokens = [ev.token for ev in loop.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0), export)]
    assert tokens == reference(prompt, 1)
    assert seen == [(layer, len(prompt)) for layer in range(engine.cfg.n_layers)]


def test_a_failing_export_drops_only_its_request(loop_factory):
    _, loop = loop_factory()

    def export(layer, table, n):
        raise BrokenPipeError("reader gone")

    with pytest.raises(Cancelled):
        list(loop.submit([1, 2, 3], GREEDY, export))
    assert run(loop, [1, 2, 3])[0] == reference([1, 2, 3], 12)
