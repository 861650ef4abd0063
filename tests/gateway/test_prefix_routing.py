"""Prefix-aware, load-aware pair choice (services/gateway/fleet/prefix_routing.py, kv_index.py).

The index follows real KVEvents messages; the pair choice reads real load books. The live path,
with real engines' events, is tests/stack/test_kv_events_live.py and tests/stack/test_up_pairs.py.
"""
from __future__ import annotations

import asyncio

from services.engine.kv_events import KVEventLog
from services.gateway.fleet.engine_client import EngineClients
from services.gateway.fleet.kv_index import EngineBlocks, prompt_hashes
from services.gateway.fleet.pairs import Pairs
from services.gateway.fleet.prefix_routing import PrefixPolicy, place
from services.rpc.hybridserve.v1 import engine_pb2 as pb

PROMPT = list(range(100, 164))  # 4 blocks of 16


def info_of(log: KVEventLog, blocks: EngineBlocks, block_size: int = 16) -> pb.InfoResponse:
    """What an engine's Info answers to `blocks`' cursor."""
    d = log.since(blocks.epoch, blocks.seq)
    return pb.InfoResponse(block_size=block_size, kv_events=pb.KVEvents(
        epoch=d.epoch, seq=d.seq, snapshot=d.snapshot, stored=d.stored, removed=d.removed, partial=d.partial))


def test_the_index_follows_stored_removed_and_snapshots():
    log, blocks = KVEventLog(), EngineBlocks()
    chain = prompt_hashes(PROMPT, 16)
    for k in chain[:3]:
        log.stored(k)
    blocks.apply(info_of(log, blocks))
    assert blocks.hit_tokens(PROMPT, {}) == 48
    log.removed(chain[1])  # the middle block evicted: only the first is a usable prefix
    blocks.apply(info_of(log, blocks))
    assert blocks.hit_tokens(PROMPT, {}) == 16
    restarted = KVEventLog()  # a new epoch: the old picture is dropped, not merged
    restarted.stored(chain[0])
    restarted.stored(chain[1])
    blocks.apply(info_of(restarted, blocks))
    assert blocks.hashes == set(chain[:2]) and blocks.hit_tokens(PROMPT, {}) == 32
    blocks.apply(pb.InfoResponse(block_size=16))  # no kv_events: an engine without a prefix cache
    assert blocks.hit_tokens(PROMPT, {}) == 0


def test_the_pair_holding_the_prefix_wins_at_equal_load():
    p = place([0, 1], least_loaded=0, loads={0: 2, 1: 2}, hits={0: 0, 1: 48}, n_prompt=64,
              policy=PrefixPolicy())
    assert (p.pair, p.reason, p.hit_tokens) == (1, "prefix", 48)


def test_load_outweighs_a_small_hit_and_a_hit_outweighs_a_little_load():
    policy = PrefixPolicy(prefix_weight=2.0, balance_guard=4)
    # 16 of 64 tokens cached (worth half a request) against one more request queued: the emptier pair
    assert place([0, 1], 0, {0: 0, 1: 1}, {0: 0, 1: 16}, 64, policy).pair == 0
    # the whole prompt cached (worth two requests) against one more queued: the pair with the prefix
    assert place([0, 1], 0, {0: 0, 1: 1}, {0: 0, 1: 64}, 64, policy).pair == 1


def test_the_balance_guard_lets_load_win_past_the_threshold():
    policy = PrefixPolicy(prefix_weight=100.0, balance_guard=4)  # affinity alone would never let go
    assert place([0, 1], 0, {0: 0, 1: 4}, {0: 0, 1: 64}, 64, policy).pair == 1  # 4 apart: not past it
    p = place([0, 1], 0, {0: 0, 1: 5}, {0: 0, 1: 64}, 64, policy)
    assert (p.pair, p.reason, p.best_hit_tokens) == (0, "balance", 64)
    off = place([0, 1], 0, {0: 0, 1: 1}, {0: 0, 1: 64}, 64, PrefixPolicy(enabled=False))
    assert (off.pair, off.reason) == (0, "load")


def test_no_hit_anywhere_is_the_least_loaded_choice_and_one_candidate_is_only():
    assert place([0, 1], 1, {0: 3, 1: 0}, {}, 64, PrefixPolicy()).reason == "load"
    assert place([1], 1, {1: 9}, {1: 64}, 64, PrefixPolicy()).reason == "only"


class Pair:
    """A pair's clients as Pairs reads them: which engines are up, and their block indexes."""

    def __init__(self):
        self.up = {"gpu": True, "fpga": True}
        self.blocks = {"gpu": EngineBlocks(), "fpga": EngineBlocks()}


def test_pairs_place_reads_the_mode_engines_blocks_and_hybrid_takes_either():
    pairs = Pairs([Pair(), Pair()])
    for p in (0, 1):
        for e in ("gpu", "fpga"):
            pairs.loads.report(p, e, running=1, waiting=0, max_num_seqs=8, kv_usage=0.1)
    log = KVEventLog()
    for k in prompt_hashes(PROMPT, 16):
        log.stored(k)
    fpga_1 = pairs.members[1].blocks["fpga"]
    fpga_1.apply(info_of(log, fpga_1))
    assert pairs.place("fpga", PROMPT).pair == 1
    assert pairs.place("gpu", PROMPT).reason == "load"  # pair 1's prefill_gpu holds nothing
    hybrid = pairs.place("hybrid", PROMPT)
    assert (hybrid.pair, hybrid.hit_tokens) == (1, 64)
    assert pairs.place("fpga", PROMPT, exclude=frozenset({(1, "fpga")})).reason == "only"


def test_an_engine_found_down_forgets_its_blocks():
    log = KVEventLog()
    log.stored(prompt_hashes(PROMPT, 16)[0])

    async def check():
        clients = EngineClients("127.0.0.1:1", "127.0.0.1:1")  # nothing listens on port 1
        blocks = clients.blocks["fpga"]
        blocks.apply(info_of(log, blocks))
        before = blocks.hit_tokens(PROMPT, {})
        up = await clients.check("fpga")
        await clients.close()
        return before, up, blocks
    before, up, blocks = asyncio.run(check())
    assert before == 16 and up is False
    assert blocks.hit_tokens(PROMPT, {}) == 0 and blocks.epoch == ""
