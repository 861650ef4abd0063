"""The prefix cache's events through a real engine's Info (both engines, real processes on loopback):
what a prompt computed shows up under the hashes the gateway computes for it, and a cursor sees
only what is new."""
from __future__ import annotations

import pytest

from services.gateway.fleet.kv_index import EngineBlocks, prompt_hashes
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from tests.conftest import random_prompt
from tests.stack.test_hybrid import VOCAB, generate


@pytest.mark.parametrize("engine,mode", [(0, pb.MODE_GPU), (1, pb.MODE_FPGA), (1, pb.MODE_HYBRID)])
def test_a_computed_prompt_is_in_the_engines_events_under_the_gateways_hashes(stubs, engine, mode):
    stub = stubs[engine]
    blocks = EngineBlocks()
    blocks.apply(stub.Info(blocks.cursor(), timeout=10))  # a snapshot: whatever earlier tests left
    prompt = random_prompt(40, VOCAB, seed=1000 + 10 * engine + mode)
    assert blocks.hit_tokens(prompt, {}) == 0
    generate(stub, prompt, mode, max_tokens=1)
    info = stub.Info(blocks.cursor(), timeout=10)
    assert not info.kv_events.snapshot and info.block_size == 16
    assert set(prompt_hashes(prompt, 16)) <= set(info.kv_events.stored)  # two full blocks of the 40 tokens
    blocks.apply(info)
    assert blocks.hit_tokens(prompt, {}) == 32
    assert blocks.hit_tokens(prompt[:20] + [7] * 20, {}) == 16  # shares only the first block
    again = stub.Info(blocks.cursor(), timeout=10).kv_events
    assert not again.snapshot and list(again.stored) == [] and again.seq == blocks.seq
