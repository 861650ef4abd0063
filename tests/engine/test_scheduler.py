"""The scheduler on tiny inputs: admission, chunked prefill, preemption, cancellation, finishing, a seeded soak."""
from __future__ import annotations

import random

import pytest

from services.engine.request_state import RequestState
from services.engine.scheduler import RequestTooLarge, Scheduler, SchedulerConfig, Sequence

BS = 4  # tokens per block in these tests


def make_scheduler(num_blocks: int = 32, budget: int = 16, max_num_seqs: int = 4, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=budget, **kw))


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 8, first_token: int | None = None, **kw) -> Sequence:
    first = seq_id * 1000 if first_token is None else first_token
    return Sequence(seq_id, list(range(first, first + prompt_len)), max_tokens, **kw)


def step(s: Scheduler, tokens: dict[int, int] | None = None):
    """One step whose engine samples `tokens[seq_id]` (default 7) for every chunk that samples."""
    out = s.schedule()
    tokens = tokens or {}
    sampled = {c.seq_id: tokens.get(c.seq_id, 7) for c in out.chunks if c.samples}
    return out, s.update(out, sampled)


def layout(out) -> tuple[list, list]:
    """(decodes, prefills) as (seq_id, start, num_tokens, samples) tuples."""
    def rows(chunks):
        return [(c.seq_id, c.start, c.num_tokens, c.samples) for c in chunks]
    return rows(out.decodes), rows(out.prefills)


@pytest.mark.parametrize("bad", [
    dict(num_blocks=0), dict(block_size=0), dict(max_num_seqs=0),
    dict(max_num_batched_tokens=3), dict(max_num_seqs=17), dict(max_model_len=1),
])
def test_config_is_checked_at_construction(bad):
    args = dict(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=16) | bad
    with pytest.raises(ValueError):
        SchedulerConfig(**args)


def test_a_request_that_can_never_fit_is_refused_at_once():
    s = make_scheduler(num_blocks=4, max_model_len=20)
    with pytest.raises(RequestTooLarge):
        s.add(make_seq(1, 20))  # fills the context window
    with pytest.raises(RequestTooLarge):
        s.add(make_seq(2, 10, max_tokens=8))  # 17 tokens of KV: 5 blocks of 4
    s.add(make_seq(3, 10, max_tokens=7))  # 16 tokens of KV: exactly 4 blocks
    with pytest.raises(ValueError):
        s.add(make_seq(3, 2))
    assert s.num_waiting == 1


def test_admission_waits_until_the_blocks_fit():
    s = make_scheduler(num_blocks=4)
    s.add(make_seq(1, 12, max_tokens=1))  # 3 blocks
    s.add(make_seq(2, 8))  # 2 blocks: only 1 left
    out, finished = step(s)
    assert layout(out) == ([], [(1, 0, 12, True)])
    assert out.prefills[0].block_table == (0, 1, 2)
    assert [seq.seq_id for seq in finished] == [1]
    assert finished[0].status is RequestState.FINISHED_LENGTH
    out, _ = step(s)
    assert layout(out) == ([], [(2, 0, 8, True)])
    assert out.prefills[0].block_table == (3, 2)  # the free block, then the LRU cached one


def test_a_long_prompt_is_chunked_and_never_stalls_a_running_decode():
    s = make_scheduler(budget=16)
    s.add(make_seq(1, 4, max_tokens=10))
    out, _ = step(s, {1: 500})
    assert layout(out) == ([], [(1, 0, 4, True)])
    s.add(make_seq(2, 40))
    rows = [layout(step(s)[0]) for _ in range(3)]
    assert rows == [
        ([(1, 4, 1, True)], [(2, 0, 15, False)]),
        ([(1, 5, 1, True)], [(2, 15, 15, False)]),
        ([(1, 6, 1, True)], [(2, 30, 10, True)]),
    ]
    assert s.running[1].num_computed_tokens == 40 and s.running[1].num_generated == 1


def test_the_budget_left_by_one_prompt_goes_to_the_next():
    s = make_scheduler(budget=16)
    s.add(make_seq(1, 10))
    s.add(make_seq(2, 10))
    s.add(make_seq(3, 10))
    out, _ = step(s)
    assert layout(out) == ([], [(1, 0, 10, True), (2, 0, 6, False)])
    out, _ = step(s)
    assert layout(out) == ([(1, 10, 1, True)], [(2, 6, 4, True), (3, 0, 10, True)])


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(max_num_seqs=2, budget=16)
    for i in (1, 2, 3):
        s.add(make_seq(i, 2))
    out, _ = step(s)
    assert [c.seq_id for c in out.prefills] == [1, 2]
    assert (s.num_running, s.num_waiting) == (2, 1)


def test_a_prompt_shared_with_a_finished_request_starts_after_the_cached_blocks():
    s = make_scheduler()
    s.add(make_seq(1, 9, max_tokens=1, first_token=0))
    step(s)
    s.add(make_seq(2, 10, first_token=0))  # tokens 0..9: blocks 0..3 and 4..7 are cached
    out, _ = step(s)
    assert layout(out) == ([], [(2, 8, 2, True)])
    assert out.prefills[0].block_table[:2] == (0, 1)
    assert s.running[0].num_cached_tokens == 8
    assert s.prefix_cache_hit_rate == 8 / (9 + 10)


def test_blocks_of_a_prompt_still_prefilling_are_reused_only_once_computed():
    s = make_scheduler(budget=16)
    s.add(make_seq(1, 40, first_token=0))
    step(s)  # positions 0..15
    s.add(make_seq(2, 37, first_token=0))  # shares 36 tokens with sequence 1
    out, _ = step(s)
    assert layout(out) == ([], [(1, 16, 16, False)])  # the budget is spent: 2 waits
    out, _ = step(s)
    # 1 computed 32 tokens before this step: 2 reuses those, not block 8 (32..35), computed now
    assert layout(out) == ([], [(1, 32, 8, True), (2, 32, 5, True)])
    assert out.prefills[1].block_table[:8] == out.prefills[0].block_table[:8]
    assert out.prefills[1].block_table[8] != out.prefills[0].block_table[8]


def test_the_newest_request_is_preempted_when_blocks_run_out():
    s = make_scheduler(num_blocks=4)
    s.add(make_seq(1, 7, max_tokens=3))  # tokens 1000..1006
    s.add(make_seq(2, 7, max_tokens=5))  # tokens 2000..2006
    out, _ = step(s, {1: 11, 2: 21})
    assert [c.block_table for c in out.prefills] == [(0, 1), (2, 3)]
    step(s, {1: 12, 2: 22})  # both hold 9 tokens now; the next decode needs a third block
    out = s.schedule()
    assert layout(out) == ([(1, 8, 1, True)], [])
    assert out.preempted == (2,) and s.num_preemptions == 1
    assert out.decodes[0].block_table == (0, 1, 3)  # sequence 2's blocks freed, its tail evicted first
    assert [b.ref_count for b in s.block_manager.blocks] == [1, 1, 0, 1]
    seq2 = s.waiting[0]
    assert (seq2.status, seq2.num_computed_tokens, seq2.num_tokens) == (RequestState.WAITING, 0, 9)
    assert [seq.seq_id for seq in s.update(out, {1: 13})] == [1]  # its third token: max_tokens
    out, _ = step(s)  # recompute: its first block is still cached, its second was evicted
    assert layout(out) == ([], [(2, 4, 5, True)])
    assert out.prefills[0].token_ids == (2004, 2005, 2006, 21, 22)
    assert out.prefills[0].block_table == (2, 3, 1)
    assert s.running[0].num_cached_tokens == 4


def test_a_decode_that_is_itself_the_newest_gives_way_and_older_decodes_still_run():
    s = make_scheduler(num_blocks=5)
    s.add(make_seq(1, 8))
    s.add(make_seq(2, 8))
    step(s)  # both hold 9 tokens: each decode needs a third block, and one is left
    out = s.schedule()
    assert layout(out) == ([(1, 8, 1, True)], []) and out.preempted == (2,)
    assert out.decodes[0].block_table == (0, 1, 4)
    assert [b.ref_count for b in s.block_manager.blocks] == [1, 1, 0, 0, 1]
    assert [seq.seq_id for seq in s.waiting] == [2] and s.num_preemptions == 1


def test_a_sequence_stops_on_a_stop_token_and_frees_its_blocks():
    s = make_scheduler()
    s.add(make_seq(1, 5, max_tokens=10, stop_token_ids=frozenset({2})))
    step(s, {1: 9})
    _, finished = step(s, {1: 2})
    assert finished[0].status is RequestState.FINISHED_STOPPED
    assert finished[0].output_token_ids == [9, 2]
    assert s.kv_cache_usage == 0.0 and not s.has_unfinished()


def test_a_sequence_stops_at_the_context_window():
    s = make_scheduler(max_model_len=8)
    s.add(make_seq(1, 6, max_tokens=10))
    step(s)
    _, finished = step(s)
    assert finished[0].status is RequestState.FINISHED_LENGTH and finished[0].num_tokens == 8


def test_cancelling_waiting_and_running_sequences_frees_every_block():
    s = make_scheduler(num_blocks=6)
    s.add(make_seq(1, 9))
    s.add(make_seq(2, 9))
    s.add(make_seq(3, 9))  # waits: 1 and 2 hold every block
    out, _ = step(s)
    assert [c.seq_id for c in out.prefills] == [1, 2] and s.num_waiting == 1
    assert s.abort(3).status is RequestState.FINISHED_ABORTED  # waiting
    assert s.abort(1).status is RequestState.FINISHED_ABORTED  # running, decoding
    assert s.abort(2).status is RequestState.FINISHED_ABORTED  # running, mid-prefill
    assert s.abort(2) is None
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    assert [b.ref_count for b in s.block_manager.blocks] == [0] * 6


def test_a_sequence_cancelled_during_a_step_is_skipped_by_update():
    s = make_scheduler()
    s.add(make_seq(1, 3))
    s.add(make_seq(2, 3))
    out = s.schedule()
    s.abort(1)
    finished = s.update(out, {1: 5, 2: 5})
    assert finished == [] and [seq.seq_id for seq in s.running] == [2]
    assert s.running[0].output_token_ids == [5]


def test_the_step_protocol_is_enforced():
    s = make_scheduler()
    s.add(make_seq(1, 3))
    out = s.schedule()
    with pytest.raises(RuntimeError):
        s.schedule()
    with pytest.raises(ValueError):
        s.update(out, {})  # the engine owed a token for sequence 1


class FakeKVEngine:
    """Stands in for the device. The "KV" of a position is the tuple of tokens up to it (what real
    KV depends on), written into its slot through the block table. Before a step computes anything,
    every chunk checks that each earlier position of its sequence reads back the right KV: a step
    is one batched call, so a chunk cannot see what another chunk of the same step writes. A wrong
    block table, a wrong or premature prefix-cache hit, or a write into a shared block fails here."""

    def __init__(self, s: Scheduler, rng: random.Random):
        self.s, self.rng = s, rng
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block id, slot) -> tokens [0, pos]

    def step(self, out, seqs: dict[int, Sequence]) -> dict[int, int]:
        bm = self.s.block_manager
        for c in out.chunks:
            tokens = seqs[c.seq_id].token_ids
            assert c.token_ids == tuple(tokens[c.start:c.start + c.num_tokens])
            for pos in range(c.start):
                assert self.slots.get(self._slot(c.block_table, pos)) == tuple(tokens[:pos + 1])
        for c in out.chunks:
            tokens = seqs[c.seq_id].token_ids
            for pos in range(c.start, c.start + c.num_tokens):
                slot = self._slot(c.block_table, pos)
                assert bm.blocks[slot[0]].ref_count == 1, "a write into a block another sequence reads"
                self.slots[slot] = tuple(tokens[:pos + 1])
        return {c.seq_id: self.rng.randrange(40) for c in out.chunks if c.samples}

    @staticmethod
    def _slot(block_table, pos: int) -> tuple[int, int]:
        return block_table[pos // BS], pos % BS


def check_reference_counts(s: Scheduler) -> None:
    bm = s.block_manager
    tables = [bm.block_table(seq.seq_id) for seq in s.running]
    assert [b.ref_count for b in bm.blocks] == [sum(t.count(b.block_id) for t in tables) for b in bm.blocks]
    assert all(len(t) * BS >= seq.num_computed_tokens for t, seq in zip(tables, s.running))


def test_seeded_soak_runs_everything_to_completion_and_frees_every_block():
    rng = random.Random(1234)
    s = make_scheduler(num_blocks=32, budget=16, max_num_seqs=6, max_model_len=128)
    engine = FakeKVEngine(s, rng)
    prefixes = [[rng.randrange(40) for _ in range(40)] for _ in range(3)]  # shared system prompts
    seqs: dict[int, Sequence] = {}
    done: list[Sequence] = []
    for seq_id in range(120):
        prompt = rng.choice(prefixes)[:rng.randrange(41)] + [rng.randrange(40) for _ in range(rng.randrange(1, 30))]
        seqs[seq_id] = Sequence(seq_id, prompt, max_tokens=rng.randrange(1, 25), stop_token_ids=frozenset({0}))
    pending = list(seqs.values())
    for _ in range(5000):
        if not pending and not s.has_unfinished():
            break
        for _ in range(rng.randrange(3)):
            if pending:
                s.add(pending.pop(0))
        if rng.random() < 0.05 and s.has_unfinished():
            done.append(s.abort(rng.choice([q.seq_id for q in (*s.waiting, *s.running)])))
        out = s.schedule()
        done += s.update(out, engine.step(out, seqs))
        check_reference_counts(s)
    assert not pending and not s.has_unfinished()
    assert sorted(seq.seq_id for seq in done) == list(range(120))
    assert all(seq.status.finished and seq.num_generated <= seq.max_tokens for seq in done)
    assert all(seq.num_generated == seq.max_tokens or seq.num_tokens == 128
               for seq in done if seq.status is RequestState.FINISHED_LENGTH)
    bm = s.block_manager
    assert [b.ref_count for b in bm.blocks] == [0] * 32
    assert bm.num_free_blocks == 32 and s.kv_cache_usage == 0.0
    # the soak went through the paths it is meant to stress
    assert s.num_preemptions > 0 and bm.num_hit_tokens > 0
    assert {seq.status for seq in done} == {RequestState.FINISHED_LENGTH, RequestState.FINISHED_STOPPED,
                                             RequestState.FINISHED_ABORTED}


# ---- hybrid: KV computed by another engine ------------------------------------------------
def test_remote_kv_reserves_blocks_past_the_cached_prefix_then_joins_the_decodes():
    s = make_scheduler(num_blocks=8)
    s.add(make_seq(1, 2 * BS + 1))
    step(s, {1: 7})  # the local prompt's two full blocks enter the prefix cache
    remote = make_seq(2, 2 * BS + 1, first_token=1000)  # the same prompt tokens
    table = s.reserve_remote(remote)
    local_table = s.block_manager.block_table(1)
    assert table[:2] == local_table[:2] and table[2] not in local_table  # cached prefix + one fresh block
    assert remote.num_cached_tokens == 2 * BS  # only the last position's KV needs importing
    assert remote.status is RequestState.WAITING_FOR_REMOTE_KV
    out = s.schedule()  # a reserved sequence is not scheduled until it is activated
    assert [c.seq_id for c in out.chunks] == [1]
    s.update(out, {1: 5})
    s.activate_remote(2, 9)
    out = s.schedule()
    assert [(c.seq_id, c.start, c.token_ids) for c in out.decodes] == [(1, 2 * BS + 2, (5,)),
                                                                        (2, 2 * BS + 1, (9,))]
    s.update(out, {1: 5, 2: 4})
    assert s.running[1].output_token_ids == [9, 4]


def test_imported_blocks_enter_the_prefix_cache_once_activated():
    s = make_scheduler(num_blocks=8)
    first = make_seq(1, 2 * BS + 1, max_tokens=4)
    s.reserve_remote(first)
    assert first.num_cached_tokens == 0
    second = make_seq(2, 2 * BS + 1, max_tokens=4, first_token=1000)
    s.reserve_remote(second)  # the first one's KV is not there yet: no hit
    assert second.num_cached_tokens == 0
    s.activate_remote(1, 3)
    for _ in range(3):
        step(s, {1: 3})
    s.add(make_seq(3, 2 * BS + 1, first_token=1000))  # the same prompt, computed here
    out = s.schedule()
    assert out.prefills[0].start == 2 * BS  # the imported blocks are reused


def test_remote_kv_waits_when_no_blocks_are_free_and_aborting_it_frees_them():
    s = make_scheduler(num_blocks=2)
    assert s.reserve_remote(make_seq(1, 2 * BS, max_tokens=1)) is not None
    assert s.reserve_remote(make_seq(2, BS, max_tokens=1)) is None
    assert s.block_manager.num_free_blocks == 0
    s.abort(1)
    assert s.block_manager.num_free_blocks == 2 and not s.has_unfinished()
    with pytest.raises(ValueError):
        s.activate_remote(1, 3)


def test_a_remote_sequence_may_finish_on_its_first_token():
    s = make_scheduler(num_blocks=4)
    s.reserve_remote(make_seq(1, BS + 1, max_tokens=1))
    seq = s.activate_remote(1, 3)
    assert seq.status is RequestState.FINISHED_LENGTH
    assert s.block_manager.num_free_blocks == 4 and not s.has_unfinished()


def test_a_prompt_wanting_every_rows_logits_is_recomputed_in_chunks_of_the_logit_rows():
    s = make_scheduler(budget=16, prompt_logit_rows=6)
    s.add(make_seq(1, 12, first_token=100))
    while s.has_unfinished():  # its blocks enter the prefix cache
        step(s)
    s.add(make_seq(2, 12, first_token=100, all_logits=True))
    s.add(make_seq(3, 12, first_token=100))  # the same prompt, as usual: from the cache
    out, _ = step(s)
    by_seq = {c.seq_id: c for c in out.prefills}
    assert (by_seq[2].start, by_seq[2].num_tokens, by_seq[2].all_logits) == (0, 6, True)  # nothing cached
    assert by_seq[3].start == 8 and not by_seq[3].all_logits  # two cached blocks
    out, _ = step(s)
    assert [(c.seq_id, c.start, c.num_tokens, c.samples) for c in out.prefills] == [(2, 6, 6, True)]


def test_drafts_never_leave_a_later_decode_short_of_a_block():
    from services.engine.speculation import SpeculationConfig

    # 4 blocks of 4: two 4-token prompts fill one each; each decode's newest token then needs a second block,
    # and the two free blocks are exactly those: the first sequence's drafts (it repeats itself) must not take them
    s = make_scheduler(num_blocks=4, speculation=SpeculationConfig(k=4, n_min=2, n_max=2, max_batch=4))
    s.add(Sequence(1, [1, 2, 1, 2], 8))
    s.add(Sequence(2, [5, 6, 5, 6], 8))
    step(s, {1: 1, 2: 5})
    out, _ = step(s, {1: 2, 2: 6})
    assert out.preempted == () and [c.seq_id for c in out.decodes] == [1, 2]
    assert all(c.num_drafts == 0 for c in out.decodes)
    # with a block to spare the repeating sequence drafts, the other still decodes
    s = make_scheduler(num_blocks=6, speculation=SpeculationConfig(k=4, n_min=2, n_max=2, max_batch=4))
    s.add(Sequence(1, [1, 2, 1, 2], 8))
    s.add(Sequence(2, [5, 6, 5, 6], 8))
    step(s, {1: 1, 2: 5})
    out = s.schedule()
    assert out.preempted == () and out.decodes[0].num_drafts > 0 and out.decodes[1].seq_id == 2
