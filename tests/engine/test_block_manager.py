"""The block manager on tiny inputs: exact block ids, reference counts, prefix reuse, LRU eviction, collisions."""
from __future__ import annotations

import pytest

from services.engine import block_manager as bm_module
from services.engine.block_manager import BlockManager, blocks_for_budget

BS = 4  # tokens per block in these tests


def make_manager(num_blocks: int = 8, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, block_size=BS, enable_prefix_caching=caching)


def tokens(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def computed(bm: BlockManager, seq_id: int, token_ids: list[int]) -> None:
    """Allocate and pretend the engine computed every token."""
    bm.allocate(seq_id, token_ids)
    bm.cache_full_blocks(seq_id, token_ids, len(token_ids))


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_blocks_for_budget_divides_the_budget_by_the_bytes_of_one_block():
    # K and V x 2 layers x 2 heads x 4 dims x 4 bytes x 16 tokens = 2048 bytes a block
    assert blocks_for_budget(1 << 20, 2, 2, 4, 4, 16) == 512
    assert blocks_for_budget(2047, 2, 2, 4, 4, 16) == 0
    with pytest.raises(ValueError):
        blocks_for_budget(1 << 20, 2, 0, 4, 4, 16)
    with pytest.raises(ValueError):
        BlockManager(0)


def test_allocate_and_free_give_exact_block_ids():
    bm = make_manager(num_blocks=4, caching=False)
    assert bm.allocate(1, tokens(0, 10)) == 0
    assert bm.allocate(2, tokens(100, 3)) == 0
    assert (bm.block_table(1), bm.block_table(2)) == ([0, 1, 2], [3])
    assert ref_counts(bm) == [1, 1, 1, 1] and bm.usage == 1.0
    assert bm.free(1) == [0, 1, 2]
    assert bm.num_free_blocks == 3 and bm.usage == 0.25
    bm.allocate(3, tokens(200, 8))
    assert bm.block_table(3) == [2, 1]  # freed last block first
    assert ref_counts(bm) == [0, 1, 1, 1]


def test_append_slots_grows_the_table_only_at_a_block_boundary():
    bm = make_manager(num_blocks=3)
    bm.allocate(1, tokens(0, 4))
    assert bm.can_append(1, 4)
    bm.append_slots(1, 4)
    assert bm.block_table(1) == [0]
    bm.append_slots(1, 5)
    assert bm.block_table(1) == [0, 1]
    assert bm.can_append(1, 12) and not bm.can_append(1, 13)
    with pytest.raises(RuntimeError):
        bm.append_slots(1, 13)
    assert bm.block_table(1) == [0, 1]


def test_admission_refused_when_blocks_do_not_fit():
    bm = make_manager(num_blocks=3)
    bm.allocate(1, tokens(0, 8))
    assert bm.can_allocate(tokens(50, 4))
    assert not bm.can_allocate(tokens(50, 5))
    with pytest.raises(RuntimeError):
        bm.allocate(2, tokens(50, 5))
    assert not bm.has(2) and ref_counts(bm) == [1, 1, 0]


def test_a_new_sequence_reuses_its_longest_cached_prefix():
    bm = make_manager()
    computed(bm, 1, tokens(0, 10))  # blocks 0, 1 full and registered; block 2 partial
    shared = tokens(0, 8) + [77, 78, 79]
    assert bm.allocate(2, shared) == 8
    assert bm.block_table(2) == [0, 1, 3]
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (10 + 11, 8)
    # same first block, other second block: only the first is reused
    assert bm.allocate(3, tokens(0, 4) + [9, 9, 9, 9, 9]) == 4
    assert bm.block_table(3) == [0, 4, 5]


def test_the_last_prompt_token_is_never_served_from_the_cache():
    bm = make_manager()
    computed(bm, 1, tokens(0, 8))
    assert bm.allocate(2, tokens(0, 8)) == 4  # block 1 would cover the last token
    assert bm.block_table(2) == [0, 2]
    assert bm.allocate(3, tokens(0, 9)) == 8
    assert bm.block_table(3) == [0, 1, 3]


def test_blocks_are_registered_only_once_computed():
    bm = make_manager()
    bm.allocate(1, tokens(0, 8))
    bm.cache_full_blocks(1, tokens(0, 8), 5)  # a prefill chunk of 5: block 0 only
    assert bm.allocate(2, tokens(0, 9)) == 4
    with pytest.raises(ValueError):
        bm.cache_full_blocks(1, tokens(0, 8), 9)  # more tokens than its blocks hold


def test_unreferenced_cached_blocks_are_evicted_least_recently_released_first():
    bm = make_manager(num_blocks=4)
    computed(bm, 1, tokens(0, 8))  # blocks 0, 1
    bm.free(1)  # released tail first: LRU order 1, 0
    computed(bm, 2, tokens(20, 4))  # block 2
    bm.free(2)  # LRU order 1, 0, 2
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    bm.allocate(3, tokens(40, 12))
    assert bm.block_table(3) == [3, 1, 0]  # the free block, then the two oldest cached ones
    bm.free(3)
    assert bm.allocate(4, tokens(0, 5)) == 0  # sequence 1's prefix is gone
    assert bm.allocate(5, tokens(20, 5)) == 4  # sequence 2's block survived
    assert bm.block_table(5)[0] == 2


def test_a_cache_hit_refreshes_a_block_in_the_lru_order():
    bm = make_manager(num_blocks=3)
    computed(bm, 1, tokens(0, 4))  # block 0
    computed(bm, 2, tokens(10, 4))  # block 1
    bm.free(1)
    bm.free(2)  # LRU order 0, 1
    assert bm.allocate(3, tokens(0, 5)) == 4  # hit on block 0, plus block 2
    bm.free(3)  # LRU order 1, 0 (block 2 was uncached: back on the free list)
    bm.allocate(4, tokens(90, 8))
    assert bm.block_table(4) == [2, 1]


def test_a_referenced_block_is_never_evicted():
    bm = make_manager(num_blocks=3)
    computed(bm, 1, tokens(0, 8))  # blocks 0, 1 registered and referenced
    assert not bm.can_allocate(tokens(50, 5))
    bm.allocate(2, tokens(50, 4))
    assert bm.block_table(2) == [2]
    assert bm.block_table(1) == [0, 1] and ref_counts(bm) == [1, 1, 1]


def test_a_constant_hash_never_reuses_a_block_of_other_tokens(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, toks: b"same")
    bm = make_manager()
    computed(bm, 1, tokens(0, 9))  # block 0 registered under b"same"; block 1 collides: not registered
    assert bm.allocate(2, tokens(4, 9)) == 0  # its first block is block 1's tokens, not block 0's
    assert bm.block_table(2) == [3, 4, 5]
    assert bm.allocate(3, tokens(0, 9)) == 4  # block 0 itself is still found: the tokens match
    assert bm.block_table(3) == [0, 6, 7]


def test_a_hash_blind_to_the_parent_never_reuses_a_block_computed_after_another(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, toks: bytes(str(toks), "ascii"))
    bm = make_manager()
    computed(bm, 1, tokens(0, 9))  # block 1 holds tokens 4..7 computed after tokens 0..3
    # same tokens 4..7, but as the first block: their KV differs, so no reuse
    assert bm.allocate(2, tokens(4, 5)) == 0
    assert bm.block_table(2) == [3, 4]


def test_freeing_everything_leaves_every_count_at_zero():
    bm = make_manager(num_blocks=6)
    computed(bm, 1, tokens(0, 9))
    computed(bm, 2, tokens(0, 6))
    bm.allocate(3, tokens(50, 3))
    for seq_id in (2, 3, 1):
        bm.free(seq_id)
    assert ref_counts(bm) == [0] * 6
    assert bm.num_free_blocks == 6 and bm.usage == 0.0


def test_a_peek_at_the_cache_takes_nothing_and_a_cap_limits_the_hits():
    bm = make_manager()
    prompt = tokens(0, 13)  # 3 full blocks cacheable (the last token never comes from the cache)
    computed(bm, 1, prompt)
    bm.free(1)
    before = (ref_counts(bm), bm.num_free_blocks, bm.num_queried_tokens)
    assert bm.cached_prefix_tokens(prompt) == 12 and bm.cached_prefix_tokens(tokens(100, 13)) == 0
    assert (ref_counts(bm), bm.num_free_blocks, bm.num_queried_tokens) == before
    # another engine was asked for the positions from 4 on: only the first block may be shared
    assert bm.allocate(2, prompt, max_cached_tokens=4) == 4
    table = bm.block_table(2)
    assert [bm.blocks[b].ref_count for b in table] == [1, 1, 1, 1]
    assert all(bm.blocks[b].hash is None for b in table[1:])  # fresh blocks to write into, none shared


def test_reset_prefix_cache_forgets_only_unreferenced_blocks():
    bm = make_manager()
    held, dropped = tokens(0, 9), tokens(50, 9)
    computed(bm, 1, held)
    computed(bm, 2, dropped)
    bm.free(2)
    assert bm.reset_prefix_cache() == 2
    assert bm.cached_prefix_tokens(dropped) == 0 and bm.cached_prefix_tokens(held) == 8
    assert bm.num_free_blocks == 8 - 3 and bm.reset_prefix_cache() == 0
    bm.free(1)
    assert bm.reset_prefix_cache() == 2 and bm.num_free_blocks == 8


def test_truncate_frees_only_the_blocks_past_the_kept_positions_back_to_the_free_list():
    bm = make_manager(num_blocks=8)
    computed(bm, 1, tokens(0, 6))  # blocks 0 (full, cached) and 1 (2 of 4 positions)
    bm.append_slots(1, 6 + 5)  # a verify step's drafts: positions up to 10, blocks 1 and 2
    assert bm.block_table(1) == [0, 1, 2] and bm.num_free_blocks == 5
    assert bm.truncate(1, 8) == [2]  # 2 drafts accepted: 8 positions fit blocks 0 and 1
    assert bm.block_table(1) == [0, 1] and bm.num_free_blocks == 6 and ref_counts(bm)[2] == 0
    assert bm.truncate(1, 8) == []  # nothing more to cut
    assert bm.truncate(1, 1) == [1]  # never below a registered (cached) block: block 0 stays
    assert bm.block_table(1) == [0]
    bm.free(1)
    assert bm.num_free_blocks == 8  # block 0 evictable, the rest free: nothing leaked


def test_a_thousand_rejected_drafts_leak_no_block():
    bm = make_manager(num_blocks=8)
    computed(bm, 1, tokens(0, 3))
    for step in range(1000):
        n = 3 + step // 100  # the sequence grows by one token every 100 steps
        bm.append_slots(1, n + 4)  # room for 4 drafts
        bm.truncate(1, n + 1)  # all rejected: only the target's own token stays
    assert len(bm.block_table(1)) == bm.blocks_needed(3 + 999 // 100 + 1)
    bm.free(1)
    assert bm.num_free_blocks == 8 and all(c == 0 for c in ref_counts(bm))
