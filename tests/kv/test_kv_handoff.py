"""The hand-off seam over both transports: real shared memory and real in-process memory,
a real torch engine's KV blocks receiving (tests/kv/block_sink.py). What arrives must be what the
request expects."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from services.kv.arena import Arena, ArenaReader
from services.kv.handoff import HandoffState, PrefillDone
from services.kv.header import HeaderMismatch, SlotHeader
from services.kv.inprocess import InProcessLink, InProcessReceiver, InProcessSender
from services.kv.layout import WIRE_DTYPES
from services.kv.shm import ShmReceiver, ShmSender
from tests.kv.block_sink import BlockSink

N_TOKENS = 17


@pytest.fixture
def arena():
    a = Arena(8 << 20)
    yield a
    a.close()


class Shm:
    def __init__(self, arena):
        self.arena, self.reader = arena, ArenaReader(arena.name)

    def sender(self, header):
        return ShmSender(self.arena, header, wait_s=0)

    def receiver(self, engine, seq, expected):
        return ShmReceiver(self.reader, engine, seq, expected)

    @property
    def in_use(self):
        return self.arena.slots_in_use


class InProcess:
    def __init__(self, _arena):
        self.link = InProcessLink()

    def sender(self, header):
        return InProcessSender(self.link, header)

    def receiver(self, engine, seq, expected):
        return InProcessReceiver(self.link, engine, seq, expected)

    @property
    def in_use(self):
        return self.link.slots_in_use


TRANSPORTS = [Shm, InProcess]


def header_for(cfg, n_tokens=N_TOKENS, dtype="fp32"):
    return SlotHeader(dtype, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_tokens, cfg.model_id)


def send_all(sender, kv):
    """Every layer of `kv` [layers, 2, kv_heads, tokens, dim] through `sender`: the messages, in order."""
    msgs = [sender.open()]
    for layer in range(kv.shape[0]):
        sender.layer_buffer(layer)[...] = kv[layer]
        msgs.append(sender.layer_written(layer))
    sender.finish()
    return msgs + [PrefillDone(first_token=7, prefill_s=0.1, queue_s=0.0, compute_done_at=0.0)]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_every_layer_arrives_in_the_receiving_sequence(transport, dtype, arena, torch_engine, model_config):
    t = transport(arena)
    header = header_for(model_config, dtype=dtype)
    shape = (model_config.n_layers, 2, model_config.n_kv_heads, N_TOKENS, model_config.head_dim)
    kv = np.random.default_rng(0).normal(size=shape).astype(WIRE_DTYPES[dtype].numpy)
    seq = BlockSink(torch_engine, N_TOKENS + 1)
    with t.sender(header) as sender:
        msgs = send_all(sender, kv)
        assert t.in_use == 1 and sender.state is HandoffState.DONE
        receiver = t.receiver(seq, None, header)
        done = receiver.consume(iter(msgs))
    assert t.in_use == 0  # closing the sender freed its memory
    assert done.first_token == 7 and receiver.state is HandoffState.DONE and seq.length == N_TOKENS
    assert receiver.bytes == kv.nbytes
    np.testing.assert_array_equal(seq.kv(N_TOKENS), kv.astype(np.float32))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("field,value,named", [("n_tokens", N_TOKENS + 1, "18 tokens"),
                                               ("dtype", "fp16", "of fp16")])
def test_a_slot_for_another_prompt_length_or_dtype_is_refused(transport, field, value, named, arena, model_config):
    """The sender's header and grant agree with each other, but not with the request the receiver
    made: the receiver must not take the sender's word for the prompt length or the dtype."""
    t = transport(arena)
    expected = header_for(model_config)
    with t.sender(dataclasses.replace(expected, **{field: value})) as sender:
        grant = sender.open()
        receiver = t.receiver(None, None, expected)
        with pytest.raises(HeaderMismatch, match=named):
            receiver.accept(grant)
    assert receiver.state is HandoffState.FAILED


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_grant_that_contradicts_its_header_is_refused(transport, arena, model_config):
    t = transport(arena)
    expected = header_for(model_config)
    with t.sender(dataclasses.replace(expected, n_tokens=N_TOKENS + 1)) as sender:
        grant = dataclasses.replace(sender.open(), n_tokens=N_TOKENS)  # the message lies about the header
        with pytest.raises(HeaderMismatch, match=f"n_tokens={N_TOKENS + 1} \\(expected {N_TOKENS}\\)"):
            t.receiver(None, None, expected).accept(grant)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_layers_out_of_place_or_missing_are_refused(transport, arena, torch_engine, model_config):
    t = transport(arena)
    header = header_for(model_config)
    with t.sender(header) as sender:
        grant = sender.open()
        ready = sender.layer_written(2)
        seq = BlockSink(torch_engine, N_TOKENS + 1)
        receiver = t.receiver(seq, None, header)
        with pytest.raises(HeaderMismatch, match="before its slot was granted"):
            receiver.import_layer(ready)
        receiver = t.receiver(seq, None, header)
        receiver.accept(grant)
        with pytest.raises(HeaderMismatch, match="not where"):
            receiver.import_layer(dataclasses.replace(ready, offset=ready.offset + 4))
        assert receiver.state is HandoffState.FAILED
        receiver = t.receiver(seq, None, header)
        receiver.accept(grant)
        receiver.import_layer(ready)
        with pytest.raises(HeaderMismatch, match="after 1 of 30 layers"):
            receiver.finish()


def test_a_stream_that_ends_early_fails_the_handoff(arena, model_config):
    t = Shm(arena)
    header = header_for(model_config)
    with t.sender(header) as sender:
        receiver = t.receiver(None, None, header)
        assert receiver.consume(iter([sender.open()])) is None
    assert receiver.state is HandoffState.FAILED and sender.state is HandoffState.FAILED
    assert t.in_use == 0


def test_an_unknown_wire_dtype_is_refused(arena, model_config):
    with pytest.raises(ValueError, match="wire dtype"):
        ShmSender(arena, header_for(model_config, dtype="bf16"), wait_s=0)
