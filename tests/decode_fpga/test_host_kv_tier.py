"""The host-memory KV tier (services/engine/host_kv_tier.py) under the real OpenCL engine: a small
device pool (the scheduler hands out 14 of the engine's blocks) evicts a prompt's prefix; with the
tier the prompt's return loads it back from host memory and decodes the same tokens as its first
run, without it only what stayed on the device is reused."""
from __future__ import annotations

import numpy as np
import pytest

from services.engine.engine_loop import EngineLoop
from services.engine.sampling import SamplingParams
from services.engine.scheduler import SchedulerConfig
from tests.conftest import random_prompt

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def returning_prompt(engine, vocab: int, host_mb: int) -> tuple[list[int], list[int], int, object]:
    """(first run's tokens, return's tokens, prompt tokens the return found cached, the loop's tier)."""
    config = SchedulerConfig(num_blocks=14, block_size=engine.block_size, max_num_seqs=1, max_num_batched_tokens=64,
                             max_model_len=512, host_kv_cache_mb=host_mb)
    loop = EngineLoop(engine, config)
    try:
        a, b = random_prompt(150, vocab, seed=41), random_prompt(150, vocab, seed=42)

        def run(prompt):
            return [ev.token for ev in loop.submit(prompt, GREEDY).events()]
        first = run(a)
        run(b)  # 10 blocks of 14: six of a's evicted, its tail first
        bm = loop.scheduler.block_manager
        before = bm.num_hit_tokens
        again = run(a)
        return first, again, bm.num_hit_tokens - before, bm.host_tier
    finally:
        loop.close()


def test_an_evicted_prefix_comes_back_from_host_memory_with_the_same_tokens(ocl_engine, model_config):
    first, again, cached, tier = returning_prompt(ocl_engine, model_config.vocab_size, host_mb=64)
    assert again == first
    assert cached == 144  # all 9 full blocks but the last token's: 4 stayed on the device, 5 came from host
    assert tier.saved >= 5 and tier.loaded == 5 and tier.used_bytes == tier.saved * tier._blocks[
        next(iter(tier._blocks))].kv.nbytes
    no_tier_first, no_tier_again, no_tier_cached, none = returning_prompt(ocl_engine, model_config.vocab_size, 0)
    assert none is None and no_tier_again == no_tier_first == first
    assert no_tier_cached == 64  # only the blocks that stayed on the device


def test_hybrid_mode_counts_the_host_tier_as_cached_and_takes_it_back_instead_of_a_hand_off(ocl_engine,
                                                                                                model_config):
    """decode_fpga's hybrid path asks prefill_gpu only for what `peek_cached_tokens` says is not here
    and reserves with `reserve_remote` (services/decode_fpga/hybrid.py): with the tier both count the
    evicted prefix's blocks in host memory, and the reservation loads them back."""
    def returning(host_mb: int) -> tuple[int, int]:
        config = SchedulerConfig(num_blocks=14, block_size=ocl_engine.block_size, max_num_seqs=1,
                                 max_num_batched_tokens=64, max_model_len=512, host_kv_cache_mb=host_mb)
        loop = EngineLoop(ocl_engine, config)
        try:
            a, b = random_prompt(150, model_config.vocab_size, seed=43), random_prompt(150, model_config.vocab_size,
                                                                                        seed=44)
            for prompt in (a, b):  # b evicts six of a's blocks
                list(loop.submit(prompt, GREEDY).events())
            peeked = loop.peek_cached_tokens(a)
            stream = loop.reserve_remote(a, GREEDY, max_cached_tokens=peeked)
            stream.wait_reserved(lambda: False)
            reserved = stream.seq.num_cached_tokens
            stream.cancel()
            return peeked, reserved
        finally:
            loop.close()

    assert returning(64) == (144, 144)  # 4 blocks on the device, 5 back from host memory: 6 tokens to hand over
    assert returning(0) == (64, 64)


def test_the_tier_is_bounded_and_checks_what_it_hands_back():
    from services.engine.host_kv_tier import HostKVTier

    class Blocks:
        """An engine whose block b holds the value b everywhere."""

        def __init__(self):
            self.written = {}

        def read_kv_blocks(self, table, n):
            return np.full((2, 2, 1, n, 4), float(table[0]), np.float32)

        def import_kv_blocks(self, table, layer, kv):
            if (table[0], layer) == self.refuse:
                raise ValueError(f"block {table[0]}'s layer {layer} refused")
            self.written[(table[0], layer)] = float(kv.flat[0])
            self.pending = True

        def finish_import_blocks(self):
            self.pending = False

    engine = Blocks()
    engine.refuse, engine.pending = None, False

    tier = HostKVTier(engine, budget_bytes=3 * 2 * 2 * 16 * 4 * 4, block_size=16)  # three blocks
    for b in range(5):
        tier.save(bytes([b]) * 16, (b,) * 16, b"", b)
    assert len(tier) == 3 and tier.lookup(bytes([0]) * 16, (0,) * 16, b"") is None  # the oldest went
    hit = tier.lookup(bytes([4]) * 16, (4,) * 16, b"")
    assert hit is not None and tier.lookup(bytes([4]) * 16, (9,) * 16, b"") is None  # other tokens: no
    assert tier.lookup(bytes([4]) * 16, (4,) * 16, b"other parent") is None
    tier.load(hit, 7)
    assert engine.written == {(7, 0): 4.0, (7, 1): 4.0} and not engine.pending
    # uploads run on a queue of their own: one failing midway still waits for those enqueued before it
    engine.refuse = (8, 1)  # its layer 0 is enqueued first
    with pytest.raises(ValueError, match="refused"):
        tier.load(hit, 8)
    assert not engine.pending
