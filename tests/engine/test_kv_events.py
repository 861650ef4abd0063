"""The prefix cache's event log (services/engine/kv_events.py) as the real block manager feeds it."""
from __future__ import annotations

from services.engine.block_manager import BlockManager, hash_block
from services.engine.kv_events import KVEventLog
from services.gateway.fleet.kv_index import prompt_hashes


def manager(num_blocks=8, log=None) -> tuple[BlockManager, KVEventLog]:
    log = log or KVEventLog()
    return BlockManager(num_blocks, block_size=4, events=log), log


def compute(bm: BlockManager, seq_id: int, tokens: list[int]) -> None:
    """Allocate a sequence, say all its tokens were computed, register its full blocks."""
    bm.allocate(seq_id, tokens)
    bm.cache_full_blocks(seq_id, tokens, len(tokens))


def test_registered_blocks_are_stored_events_with_the_gateways_hashes():
    bm, log = manager()
    tokens = list(range(10))  # two full blocks of 4, and 2 tokens
    compute(bm, 1, tokens)
    d = log.since("", 0)
    assert d.snapshot and d.stored == prompt_hashes(tokens, 4) == [hash_block(b"", tokens[:4]),
                                                                   hash_block(hash_block(b"", tokens[:4]), tokens[4:8])]
    assert log.since(d.epoch, d.seq).stored == [] and not log.since(d.epoch, d.seq).snapshot
    compute(bm, 2, tokens[:4] + [99, 98, 97, 96])  # shares the first block: one new hash
    new = log.since(d.epoch, d.seq)
    assert not new.snapshot and new.stored == prompt_hashes(tokens[:4] + [99, 98, 97, 96], 4)[1:] and not new.removed


def test_evicted_and_reset_blocks_are_removed_events():
    bm, log = manager(num_blocks=3)
    compute(bm, 1, list(range(8)))  # 2 blocks cached
    bm.free(1)  # evictable now
    cursor = log.since("", 0)
    compute(bm, 2, [50 + i for i in range(12)])  # needs all 3 blocks: evicts both cached ones
    d = log.since(cursor.epoch, cursor.seq)
    assert set(d.removed) == set(prompt_hashes(list(range(8)), 4))
    assert d.stored == prompt_hashes([50 + i for i in range(12)], 4)
    bm.free(2)
    assert bm.reset_prefix_cache() == 3
    after = log.since(d.epoch, d.seq)
    assert set(after.removed) == set(d.stored) and log.since("", 0).stored == []


def test_a_reader_too_far_behind_or_of_another_epoch_gets_a_snapshot():
    log = KVEventLog(capacity=4, max_hashes=100)
    keys = [bytes([i]) * 16 for i in range(10)]
    for k in keys[:6]:
        log.stored(k)
    log.removed(keys[0])
    d = log.since(log.epoch, 1)  # events 2.. were dropped (capacity 4): a snapshot of what is cached
    assert d.snapshot and d.stored == keys[1:6]
    assert log.since("another engine start", 7).snapshot
    assert log.since(log.epoch, 99).snapshot  # a cursor from the future: the engine restarted
    small = KVEventLog(max_hashes=3)
    for k in keys:
        small.stored(k)
    snap = small.since("", 0)
    assert snap.partial and snap.stored == keys[-3:]  # bounded: the newest
