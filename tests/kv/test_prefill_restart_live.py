"""prefill_gpu SIGKILLed and started again under a running decode_fpga: real processes, real arena.

Before the KV was tied to its request, decode_fpga went on reading the dead process's
arena: a hybrid prompt of the length of one served before the kill decoded from that
old request's KV (wrong tokens, no error), and any other length failed until decode_fpga
was restarted too. Now the new prefill_gpu removes the dead one's segment, decode_fpga
maps the new arena, and every hybrid request gives the tokens of a fresh stack.
"""
from __future__ import annotations

import signal

import grpc

from services.decode_fpga.settings import DecodeSettings
from services.kv.arena import SHM_DIR
from services.prefill_gpu.settings import PrefillSettings
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc
from tests.conftest import random_prompt
from tests.services_harness import engine_pair

VOCAB = 49152
N_IN = 48  # every prompt here has this length: a stale slot would pass every length check
PREFILL_ENV = {PrefillSettings.env_name("arena_bytes"): str(32 << 20)}
DECODE_ENV = {DecodeSettings.env_name("max_context"): "256", DecodeSettings.env_name("max_sequences"): "2"}


def generate(stub, prompt, mode, max_tokens=8) -> list[int]:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [t for msg in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=params, mode=mode),
                                       timeout=180) for t in msg.token_ids]


def test_hybrid_after_prefill_restart_gives_a_fresh_stacks_tokens(tmp_path, profile_cache):
    prefill, decode = engine_pair(tmp_path, PREFILL_ENV, DECODE_ENV, profile_cache)
    try:
        prefill.wait_healthy(timeout=300)
        decode.wait_healthy(timeout=300)
        with grpc.insecure_channel(decode.address) as ch:
            dec = pb_grpc.EngineStub(ch)
            before = random_prompt(N_IN, VOCAB, seed=101)
            assert generate(dec, before, pb.MODE_HYBRID) == generate(dec, before, pb.MODE_FPGA)
            with grpc.insecure_channel(prefill.address) as pch:
                old_arena = pb_grpc.EngineStub(pch).Info(pb.InfoRequest(), timeout=10).arena_name

            prefill.stop(sig=signal.SIGKILL)
            assert (SHM_DIR / old_arena).exists()  # a killed prefill_gpu leaves its arena behind
            prefill.start().wait_healthy(timeout=300)  # same ports, a new process
            with grpc.insecure_channel(prefill.address) as pch:
                pre = pb_grpc.EngineStub(pch)
                assert pre.Info(pb.InfoRequest(), timeout=10).arena_name != old_arena
                assert not (SHM_DIR / old_arena).exists()  # the new one removed it
                for seed in (102, 103):
                    prompt = random_prompt(N_IN, VOCAB, seed=seed)
                    fresh = generate(pre, prompt, pb.MODE_GPU)  # no hand-off involved
                    assert generate(dec, prompt, pb.MODE_HYBRID) == fresh == generate(dec, prompt, pb.MODE_FPGA)
            assert "mapped KV arena" in decode.log_path.read_text()
    finally:
        decode.stop()
        prefill.stop()
