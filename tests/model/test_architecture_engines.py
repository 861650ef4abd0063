"""Every served architecture, token-identical to transformers in every mode: gpu (the torch engine),
fpga (the OpenCL engine) and hybrid (torch prefill, its KV handed to the OpenCL engine, which decodes).

Tiny checkpoints of each family are made here (tests/model/tiny_checkpoints.py): Hugging Face
directories of Llama 3 (llama3 rope scaling, untied), Qwen2 (q/k/v biases), Mistral, Qwen3 (q/k
norms, tied), GPT-2 (learned positions, LayerNorm, GELU, fused q|k|v, biases), and GGUF files of
Llama 3, Qwen2 and Qwen3 with Q8_0 matrices (the OpenCL engine keeps their blocks). Engines are built once
per checkpoint; two prompts of different lengths share every step, so each part runs over several
rows.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from services.engine.one_request import greedy_tokens
from services.engine.scheduler import ScheduledChunk
from tests.model.tiny_checkpoints import FAMILIES, family_config, prompt, save_checkpoint, save_gguf, tiny_model

N_NEW = 6
PROMPTS = (prompt(20, 1), prompt(7, 2))
CASES = FAMILIES + ("llama3-gguf", "qwen2-gguf", "qwen3-gguf")


@dataclass
class Case:
    name: str
    loaded: object
    torch_engine: object
    ocl_engine: object
    reference: list  # transformers' greedy tokens of each prompt


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.max_new_tokens, gc.do_sample = -1, 0, n, False
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), generation_config=gc)[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def device():
    from services.decode_fpga.device import select_device

    return select_device()


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory, tokenizer, device):
    from transformers import AutoModelForCausalLM

    from services.decode_fpga.config import EngineConfig
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.server import load as decode_service_load
    from services.engine.batching_settings import BatchingSettings
    from services.model.loading import load_model
    from services.prefill_gpu.engine import TorchEngine

    family, _, kind = request.param.partition("-")
    model = tiny_model(family)
    path = tmp_path_factory.mktemp(request.param)
    if kind == "gguf":
        target = save_gguf(model, family, path / f"{family}.gguf")
        # transformers reads no rope scaling from a llama GGUF (llama.cpp keeps it in rope_freqs) and no
        # head_dim from a qwen3 one (attention.key_length): the family's config says them
        extra = {"config": family_config(family)} if family in ("llama3", "qwen3") else {}
        model = AutoModelForCausalLM.from_pretrained(str(path), gguf_file=target.name, dtype=torch.float32,
                                                     **extra).eval()
    else:
        target = save_checkpoint(model, tokenizer, path)
    loaded = load_model(str(target))
    batching = BatchingSettings(kv_cache_mb=4, max_num_batched_tokens=64)
    torch_engine = TorchEngine(loaded.config, loaded.weights, device="cpu", batching=batching)
    if kind == "gguf":  # as the decode service loads it: the file's matrices never dequantized (server.load)
        settings = _decode_settings(str(target))
        ocl = OpenCLEngine.from_settings(decode_service_load(settings), settings)
    else:
        ocl = OpenCLEngine.create(loaded.config, loaded.weights, device,
                                  EngineConfig(kv_cache_mb=4, max_context=256, max_num_batched_tokens=64))
    return Case(request.param, loaded, torch_engine, ocl, [hf_greedy(model, p, N_NEW) for p in PROMPTS])


def _decode_settings(model: str):
    """The decode service's own settings (storage "auto": a GGUF's blocks), sized for a test."""
    from services.decode_fpga.settings import DecodeSettings

    return DecodeSettings(model=model, kv_cache_mb=4, max_context=256, max_num_batched_tokens=64)


def chunk(seq: int, start: int, tokens, table) -> ScheduledChunk:
    return ScheduledChunk(seq, start, tuple(int(t) for t in tokens), tuple(table), True, None)


TABLES = ([0, 1], [2, 3])  # blocks of 16: room for 20 + 6 and 7 + 6 positions


def decode_together(engine, firsts: list[int]) -> list[list[int]]:
    """Both sequences decoded in shared steps from their first tokens; their N_NEW tokens each."""
    out = [[f] for f in firsts]
    for i in range(N_NEW - 1):
        picks = engine.step([chunk(s, len(PROMPTS[s]) + i, [out[s][-1]], TABLES[s]) for s in range(2)], greedy=True)
        for s in range(2):
            out[s].append(picks[s])
    return out


def serve_alone(engine) -> list[list[int]]:
    """Both prompts prefilled in one step, then decoded together (the engine loop's way)."""
    return decode_together(engine, engine.step([chunk(s, 0, PROMPTS[s], TABLES[s]) for s in range(2)], greedy=True))


def test_gpu_mode_equals_transformers(case):
    assert serve_alone(case.torch_engine) == case.reference


def test_fpga_mode_equals_transformers(case):
    assert serve_alone(case.ocl_engine) == case.reference
    # one request through an engine loop too (what `hybridserve generate`, tools and benches run), whose
    # decode steps of one row may take the one-launch kernel
    assert greedy_tokens(case.ocl_engine, PROMPTS[0], N_NEW) == case.reference[0]


def test_hybrid_mode_equals_transformers(case):
    """torch prefills both prompts, each layer's KV goes over in wire layout into other blocks of the
    OpenCL engine, which decodes."""
    t, o, c = case.torch_engine, case.ocl_engine, case.loaded.config
    firsts = t.step([chunk(s, 0, PROMPTS[s], TABLES[s]) for s in range(2)], greedy=True)
    dst = ([4, 5], [6, 7])
    for s in range(2):
        for layer in range(c.n_layers):
            o.import_kv_blocks(dst[s], layer, t.export_kv_blocks(TABLES[s], layer, len(PROMPTS[s])).numpy())
    o.finish_import_blocks()
    out = [[f] for f in firsts]
    for i in range(N_NEW - 1):
        picks = o.step([chunk(s, len(PROMPTS[s]) + i, [out[s][-1]], dst[s]) for s in range(2)], greedy=True)
        for s in range(2):
            out[s].append(picks[s])
    assert out == case.reference


def test_one_launch_where_decode_layers_computes_the_layer(case, device, monkeypatch):
    """decode_layers.cl computes Llama's layer, with q/k/v biases (Qwen2) and q/k head norms (Qwen3) or
    not: a GGUF of such a family decodes in one launch, bit for bit the launches; any other part
    (GPT-2's) runs launch by launch, never the one launch. (An HF directory is served as fp32, which
    the one launch does not read.)"""
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.one_launch_choice import OneLaunchChoice

    from services.decode_fpga.arch_parts import one_launch_takes

    e = case.ocl_engine
    if not (one_launch_takes(case.loaded.config.arch) and case.name.endswith("gguf")):
        assert e.paged_plans.one_launch is None
        return
    assert e.paged_plans.one_launch is not None
    if not e.weights.arch.one_launch_defines():
        return  # Llama's own layer: tests/decode_fpga/test_decode_layers.py holds it to the launches
    choice = OneLaunchChoice(fixed=True)  # no tries of the other way
    monkeypatch.setattr(e, "one_launch_choice", choice)
    launches = OpenCLEngine.from_settings(case.loaded, _decode_settings(str(case.loaded.checkpoint.path)).model_copy(
        update={"opencl_layer_kernels": False}))
    assert launches.paged_plans.one_launch is None

    def decode_logits(engine):
        table = [8, 9]
        out = [engine.step([chunk(0, 0, PROMPTS[0], table)], greedy=False)[0]]
        for i in range(N_NEW - 1):
            token = int(np.argmax(out[-1]))
            out.append(engine.step([chunk(0, len(PROMPTS[0]) + i, [token], table)], greedy=False)[0])
        return np.stack(out)

    np.testing.assert_array_equal(decode_logits(e), decode_logits(launches))
    # the decode steps ran as one launch, but for any that gave up on a busy machine (redone by launches)
    assert choice.ran[True] + choice.gave_up == N_NEW - 1
    # steps of 2-4 rows (paged_rows_layers): several sequences' decodes, chunks of 3 and 4
    from tests.decode_fpga.test_paged_step import few_rows_logits, scattered_tables

    choices = {n: OneLaunchChoice(fixed=True, rows=n) for n in (2, 3, 4)}
    monkeypatch.setattr(e, "rows_launch_choices", choices)
    prompts = [list(PROMPTS[0]), list(PROMPTS[0][:3]), list(PROMPTS[0]) * 2]
    tables = scattered_tables(e, [len(p) + 20 for p in prompts], seed=14)
    for i, (a, b) in enumerate(zip(few_rows_logits(e, prompts, tables), few_rows_logits(launches, prompts, tables))):
        np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
    assert sum(c.ran[True] + c.gave_up for c in choices.values()) == 11


@pytest.mark.parametrize("engine_name", ["torch_engine", "ocl_engine"])
def test_a_verify_chunk_gives_each_row_the_token_decoding_would(case, engine_name):
    """Speculative decoding's verify chunk (the newest token and its drafts, every row's logits) on every
    architecture: with the right drafts every row's argmax is transformers' next token; with wrong ones the
    first row's still is (what follows a rejected draft is never read)."""
    engine = getattr(case, engine_name)
    vocab = case.loaded.config.vocab_size
    for wrong in (False, True):
        firsts = engine.step([chunk(s, 0, PROMPTS[s], TABLES[s]) for s in range(2)], greedy=True)
        assert list(firsts) == [r[0] for r in case.reference]
        verify = []
        for s, ref in enumerate(case.reference):
            drafts = [(t + 1) % vocab for t in ref[1:5]] if wrong else ref[1:5]
            verify.append(ScheduledChunk(s, len(PROMPTS[s]), (ref[0], *drafts), tuple(TABLES[s]), True, None,
                                         all_logits=True, num_drafts=4))
        rows = np.asarray(engine.step(verify, greedy=False)).argmax(axis=-1).reshape(2, 5)
        for s, ref in enumerate(case.reference):
            assert (rows[s, :1].tolist() if wrong else rows[s].tolist()) == (ref[1:2] if wrong else ref[1:6])
