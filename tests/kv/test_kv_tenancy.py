"""KV belongs to exactly one request: real shared memory, a real torch sequence receiving.

A slot can be freed and handed to the next request while a slow reader is still
copying it (prefill_gpu frees on a timer, or the reader is busy). The reader must
then fail the hand-off (SlotChanged, a HandoffFailed), never finish with another
request's KV. Hooks in the receiving engine stop the import at the worst moment;
the test frees and reuses the slot there, deterministically (no sleeps).
"""
from __future__ import annotations

import numpy as np
import pytest

from services.errors import HandoffFailed
from services.kv.arena import Arena, ArenaReader
from services.kv.handoff import HandoffState, PrefillDone, SlotChanged
from services.kv.header import HEADER_SIZE, HeaderMismatch, SlotHeader, request_nonce
from services.kv.shm import ShmReceiver, ShmSender
from tests.kv.block_sink import BlockSink

N_TOKENS = 9


@pytest.fixture
def arena():
    a = Arena(8 << 20)
    yield a
    a.close()


def header_for(cfg, request_id: str, n_tokens: int = N_TOKENS) -> SlotHeader:
    return SlotHeader("fp32", cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_tokens, cfg.model_id,
                      nonce=request_nonce(request_id))


def kv_of(cfg, seed: int) -> np.ndarray:
    """[layers, 2, kv_heads, tokens, dim] fp32, different for every seed."""
    shape = (cfg.n_layers, 2, cfg.n_kv_heads, N_TOKENS, cfg.head_dim)
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def write_all(sender: ShmSender, kv: np.ndarray) -> list:
    """Open, write every layer: the messages a reader gets, PrefillDone last."""
    msgs = [sender.open()]
    for layer in range(kv.shape[0]):
        sender.layer_buffer(layer)[...] = kv[layer]
        msgs.append(sender.layer_written(layer))
    sender.finish()
    return msgs + [PrefillDone(first_token=5, prefill_s=0.1, queue_s=0.0, compute_done_at=0.0)]


class HookedEngine:
    """A receiving engine (a BlockSink over the torch engine's blocks), with `hooks[layer]()` run just
    before layer `layer`'s import (a slow reader)
    and, `deferred`, the imports run only in finish_import, as an engine that enqueues its copies
    (the OpenCL one) reads the shared memory only when it waits for them."""

    def __init__(self, engine, hooks: dict, deferred: bool = False, before_finish=None):
        self.engine, self.hooks, self.deferred, self.before_finish = engine, hooks, deferred, before_finish
        self._pending: list = []

    def import_kv_layer(self, seq, layer, kv):
        if layer in self.hooks:
            self.hooks.pop(layer)()
        if self.deferred:
            self._pending.append((seq, layer, kv))  # kv: a view into the arena, read later
        else:
            self.engine.import_kv_layer(seq, layer, kv)

    def finish_import(self, seq, n_tokens):
        if self.before_finish is not None:
            self.before_finish()
        for args in self._pending:
            self.engine.import_kv_layer(*args)
        self.engine.finish_import(seq, n_tokens)


def seq_kv(sink) -> np.ndarray:
    return sink.kv(N_TOKENS)


def test_undisturbed_reader_gets_exactly_its_request_kv(arena, torch_engine, model_config):
    """The control for the tests below: with nothing in the way, the hooks change nothing."""
    kv = kv_of(model_config, 1)
    header = header_for(model_config, "request-a")
    seq = BlockSink(torch_engine, N_TOKENS + 1)
    with ShmSender(arena, header, wait_s=0) as sender:
        msgs = write_all(sender, kv)
        engine = HookedEngine(seq, {3: lambda: None}, deferred=True)
        receiver = ShmReceiver(ArenaReader(arena.name), engine, None, header)
        assert receiver.consume(iter(msgs)) is not None
    assert receiver.state is HandoffState.DONE
    np.testing.assert_array_equal(seq_kv(seq), kv)


@pytest.mark.parametrize("deferred", [False, True], ids=["copying-engine", "enqueueing-engine"])
def test_slow_reader_never_sees_the_next_requests_kv(deferred, arena, torch_engine, model_config):
    """Request a's slot is freed while its reader is stalled at layer 5 and given to request b (same
    prompt length: same offset, same size), which writes its own KV there. The reader must fail."""
    kv_a, kv_b = kv_of(model_config, 1), kv_of(model_config, 2)
    sender_a = ShmSender(arena, header_for(model_config, "request-a"), wait_s=0)
    sender_b = ShmSender(arena, header_for(model_config, "request-b"), wait_s=0)
    msgs = write_all(sender_a, kv_a)
    slot_a = sender_a.slot

    def free_a_and_give_the_slot_to_b():
        sender_a.close()
        write_all(sender_b, kv_b)
        assert sender_b.slot.offset == slot_a.offset  # b's KV is where a's reader reads

    hooks = {} if deferred else {5: free_a_and_give_the_slot_to_b}
    engine = HookedEngine(BlockSink(torch_engine, N_TOKENS + 1), hooks, deferred,
                          before_finish=free_a_and_give_the_slot_to_b if deferred else None)
    receiver = ShmReceiver(ArenaReader(arena.name), engine, None, header_for(model_config, "request-a"))
    with pytest.raises(SlotChanged, match="freed or given to another request"):
        receiver.consume(iter(msgs))
    assert receiver.state is HandoffState.FAILED
    assert isinstance(SlotChanged("x"), HandoffFailed)  # the engine's typed failure: INTERNAL, logged
    sender_b.close()


def test_a_slot_freed_under_a_reader_fails_it_even_unused(arena, torch_engine, model_config):
    header = header_for(model_config, "request-a")
    sender = ShmSender(arena, header, wait_s=0)
    msgs = write_all(sender, kv_of(model_config, 1))
    receiver = ShmReceiver(ArenaReader(arena.name), HookedEngine(BlockSink(torch_engine, N_TOKENS + 1),
                                                                 {2: sender.close}), None, header)
    with pytest.raises(SlotChanged, match="while layer 2 was copied"):
        receiver.consume(iter(msgs))


def test_free_zeroes_the_header_and_a_late_reader_gets_a_mismatch(arena, model_config):
    header = header_for(model_config, "request-a")
    sender = ShmSender(arena, header, wait_s=0)
    grant = sender.open()
    reader = ArenaReader(arena.name)
    assert reader.read_header(grant.offset).generation == sender.slot.generation > 0
    sender.close()
    assert bytes(reader.view(grant.offset, HEADER_SIZE)) == bytes(HEADER_SIZE)  # magic, nonce, generation: gone
    with pytest.raises(HeaderMismatch, match="magic"):
        reader.read_header(grant.offset)
    receiver = ShmReceiver(reader, None, None, header)
    with pytest.raises(HeaderMismatch, match="magic"):
        receiver.accept(grant)
    assert receiver.state is HandoffState.FAILED


def test_every_slot_handed_out_has_a_new_generation(arena):
    gens = []
    for _ in range(3):
        slot = arena.allocate(1000, timeout=0)
        gens.append(slot.generation)
        arena.free(slot)  # the next one takes the same offset
    assert len(set(gens)) == 3 and 0 not in gens


def test_a_late_second_free_never_frees_the_next_owner(arena, model_config):
    first = arena.allocate(100_000, timeout=0)
    arena.free(first)
    second = arena.allocate(100_000, timeout=0)
    assert (second.offset, second.size) == (first.offset, first.size)
    arena.free(first)  # the first owner's exit path frees again
    assert arena.slots_in_use == 1
    assert arena.allocate(100_000, timeout=0).offset != second.offset


def test_a_slot_of_another_request_is_refused(arena, model_config):
    """Same prompt length, same model, same dtype: only the nonce tells the requests apart."""
    with ShmSender(arena, header_for(model_config, "request-a"), wait_s=0) as sender:
        grant = sender.open()
        mine = header_for(model_config, "request-b")
        with pytest.raises(HeaderMismatch, match="another request"):
            ShmReceiver(ArenaReader(arena.name), None, None, mine).accept(grant)
        # the nonce may come with the grant instead (the decode service's peer fills it from its request)
        plain = SlotHeader("fp32", mine.n_layers, mine.n_kv_heads, mine.head_dim, N_TOKENS, mine.model_id)
        with pytest.raises(HeaderMismatch, match="another request"):
            ShmReceiver(ArenaReader(arena.name), None, None, plain).accept(
                type(grant)(**{**grant.__dict__, "nonce": request_nonce("request-b")}))


def test_a_reader_of_a_replaced_arena_maps_the_new_one(arena, torch_engine, model_config):
    """prefill_gpu restarted: the old arena still holds a slot of the same length at offset 0 (its
    process was killed mid-hand-off), the new one holds this request's. The reader must read the new."""
    kv_old, kv_new = kv_of(model_config, 1), kv_of(model_config, 2)
    old_sender = ShmSender(arena, header_for(model_config, "before-restart"), wait_s=0)
    write_all(old_sender, kv_old)  # never freed: its process died
    old_reader = ArenaReader(arena.name)
    new_arena = Arena(8 << 20)
    try:
        header = header_for(model_config, "after-restart")
        seq = BlockSink(torch_engine, N_TOKENS + 1)
        with ShmSender(new_arena, header, wait_s=0) as sender:
            msgs = write_all(sender, kv_new)
            assert msgs[0].offset == old_sender.slot.offset
            remapped = []
            receiver = ShmReceiver(old_reader, seq, None, header,
                                   remap=lambda seen: remapped.append(seen) or ArenaReader(new_arena.name))
            assert receiver.consume(iter(msgs)) is not None
        assert remapped == [old_reader] and receiver.reader.name == new_arena.name
        np.testing.assert_array_equal(seq_kv(seq), kv_new)
        # without a way to learn the new arena the reader refuses, rather than decode the old KV
        with ShmSender(new_arena, header, wait_s=0) as sender:
            msgs = write_all(sender, kv_new)
            with pytest.raises(HeaderMismatch, match="another request"):
                ShmReceiver(old_reader, seq, None, header).consume(iter(msgs))
    finally:
        new_arena.close()


def test_a_slot_view_never_reaches_past_its_slot_or_into_a_freed_one(arena):
    slot = arena.allocate(5000, timeout=0)
    assert arena.data_view(slot, slot.size - HEADER_SIZE).size == slot.size - HEADER_SIZE
    with pytest.raises(ValueError, match="do not fit"):
        arena.data_view(slot, slot.size - HEADER_SIZE + 1)
    arena.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        arena.data_view(slot, 8)
