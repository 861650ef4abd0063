"""Logprobs on the OpenCL device (kernels/logprobs.cl, device_logprobs.py): the kernel gives
services/engine/logprobs.py's numbers and order (ties: the lower id first) on real logit rows and on
rows full of ties, for k = 0, 1, 5, 20; the engine's step and the engine loop take that path for plain
greedy rows and for echo's prompt rows (2 + 2k words a row read back, the metric says where), with
the host path's tokens and logprobs."""
from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest
from prometheus_client import REGISTRY

from services.decode_fpga.device_logprobs import DeviceLogprobs
from services.engine.engine_loop import EngineLoop
from services.engine.logprobs import LogprobsAsked, token_logprob
from services.engine.sampling import SamplingParams
from services.engine.scheduler import ScheduledChunk, SchedulerConfig
from tests.conftest import random_prompt

MF = cl.mem_flags
KS = (0, 1, 5, 20)


def on_device(dev, rows: np.ndarray, targets: list[int], k: int):
    """The kernel alone over `rows`."""
    rows = np.ascontiguousarray(rows, np.float32)
    n, vocab = rows.shape
    logits = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=rows)
    lp = DeviceLogprobs(dev, logits, vocab, n)
    keep: list = []
    lp.upload(lp.check(LogprobsAsked(k, targets), n), keep)
    lp.enqueue(dev.queue, n, k)
    return lp.read(dev.queue, n, k)


def assert_same(got, rows, targets, k, tol=1e-5):
    for i, row in enumerate(rows):
        target = targets[i] if targets[i] >= 0 else int(np.argmax(row))
        want = token_logprob(row, target, k)
        assert int(got.picks[i]) == int(np.argmax(row)), i  # the first index of the max
        have = got.at(i, k)
        assert abs(have.logprob - want.logprob) < tol, (i, have.logprob, want.logprob)
        assert [t for t, _ in have.top] == [t for t, _ in want.top], (i, k)  # the same ids, the same order
        assert np.allclose([v for _, v in have.top], [v for _, v in want.top], atol=tol, rtol=0), (i, k)


def tie_rows(vocab: int) -> np.ndarray:
    """Rows whose top k is decided by the tie rule: all equal; the max at three ids in different
    work-items' chunks; logits rounded to a few values (ties straddling every k); a negative row."""
    rng = np.random.default_rng(3)
    flat = np.zeros(vocab, np.float32)
    spread = rng.normal(0, 1, vocab).astype(np.float32)
    spread[[5, vocab // 3, vocab - 1]] = 9.0
    coarse = np.round(rng.normal(0, 2, vocab)).astype(np.float32)
    negative = -50.0 + np.round(rng.normal(0, 1, vocab) * 4) / 4
    return np.stack([flat, spread, coarse, negative.astype(np.float32)])


@pytest.fixture(scope="module")
def real_rows(ocl_gguf_engine, model_config):
    """Every position's logits of a 12-token prompt (an all_logits chunk), from the engine."""
    e = ocl_gguf_engine
    prompt = random_prompt(12, model_config.vocab_size, seed=8)
    chunk = ScheduledChunk(1, 0, tuple(prompt), (0,), True, None, all_logits=True)
    return prompt, e.step([chunk], greedy=False)


@pytest.mark.parametrize("k", KS)
def test_kernel_gives_logprobs_py_numbers_and_order_on_real_rows(cl_dev, real_rows, k):
    prompt, rows = real_rows
    targets = prompt[1:] + [-1]  # each row's next prompt token; the last row: its pick
    assert_same(on_device(cl_dev, rows, targets, k), rows, targets, k)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("vocab", [49152, 1003])  # 1003: chunks of 8 with a short tail, empty work-items
def test_kernel_breaks_ties_as_logprobs_py_does(cl_dev, k, vocab):
    rows = tie_rows(vocab)
    targets = [7, -1, vocab - 1, 0]
    got = on_device(cl_dev, rows, targets, k)
    assert_same(got, rows, targets, k)
    if k:
        assert [t for t, _ in got.at(0, k).top] == list(range(k))  # all equal: the lowest ids
        top = got.at(1, k).top  # the max at three ids in different work-items' chunks: in id order
        assert [t for t, _ in top[:3]] == [5, vocab // 3, vocab - 1][:k] and len({v for _, v in top[:3]}) == 1


def test_kernel_refuses_bad_targets(cl_dev):
    lp = DeviceLogprobs(cl_dev, cl.Buffer(cl_dev.context, MF.READ_WRITE, 4 * 100), 100, 1)
    for bad in ([100], [-2], [1, 2]):
        with pytest.raises(ValueError):
            lp.check(LogprobsAsked(1, bad), 1)
    with pytest.raises(ValueError):
        LogprobsAsked(21, [0])


def test_engine_step_gives_the_host_paths_logprobs_from_the_device(ocl_gguf_engine, model_config, monkeypatch):
    """A step of a decode row and an all_logits prompt chunk: with logprobs asked, the picks and logprobs
    equal what the host computes from the same step's logits (the one-decode-row step, as one launch
    unless a busy machine makes it give up and run launch by launch, too)."""
    from services.decode_fpga.one_launch_choice import OneLaunchChoice

    e = ocl_gguf_engine
    choice = OneLaunchChoice(fixed=True)  # one launch whenever the step can (no tries of the other way)
    monkeypatch.setattr(e, "one_launch_choice", choice)
    a, b = random_prompt(20, model_config.vocab_size, seed=1), random_prompt(9, model_config.vocab_size, seed=2)
    first = e.step([ScheduledChunk(1, 0, tuple(a), (0, 1), True, None)], greedy=True)[0]
    chunks = [ScheduledChunk(1, len(a), (first,), (0, 1), True, None),
              ScheduledChunk(2, 0, tuple(b), (2,), True, None, all_logits=True)]
    targets = [-1] + b[1:] + [-1]
    rows = e.step(chunks, greedy=False)
    got = e.step(chunks, greedy=True, logprobs=LogprobsAsked(5, targets))  # the same positions rewritten
    assert len(got) == len(rows) == 1 + len(b)
    assert_same(got, rows, targets, 5)
    one = [ScheduledChunk(1, len(a), (first,), (0, 1), True, None)]
    for _ in range(3):
        assert_same(e.step(one, greedy=True, logprobs=LogprobsAsked(2, [-1])), e.step(one, greedy=False), [-1], 2)
    assert choice.ran[True] + choice.gave_up == 6  # every one-row step went the one-launch way first
    with pytest.raises(ValueError, match="greedy"):
        e.step(one, greedy=False, logprobs=LogprobsAsked(2, [-1]))


def rows_by_where() -> dict[str, float]:
    return {w: REGISTRY.get_sample_value("hybridserve_engine_logprob_rows_total", {"where": w}) or 0.0
            for w in ("device", "host")}


def test_engine_loop_takes_the_device_path_for_plain_greedy_rows_only(ocl_gguf_engine, model_config):
    e = ocl_gguf_engine
    loop = EngineLoop(e, SchedulerConfig(num_blocks=e.num_blocks, block_size=e.block_size, max_num_seqs=4,
                                         max_num_batched_tokens=e.max_num_batched_tokens, max_model_len=512),
                      model_config.eos_token_ids)
    prompt = random_prompt(30, model_config.vocab_size, seed=4)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    echo = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=4)

    def run(params):
        events = list(loop.submit(prompt, params))
        return [ev.token for ev in events], [ev.logprob for ev in events], events[0].prompt_logprobs

    try:
        runs = {}
        for where in ("device", "host"):
            e.logprobs_on_device = where == "device"
            before = rows_by_where()
            runs[where] = run(greedy), run(echo)
            after = rows_by_where()
            assert after[where] - before[where] == 4 + 2 + len(prompt) - 1, where  # every position, here
            assert after["host" if where == "device" else "device"] == before[
                "host" if where == "device" else "device"], where
        e.logprobs_on_device = True
        before = rows_by_where()
        run(SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=1, presence_penalty=0.5))
        assert rows_by_where()["host"] - before["host"] == 2  # a control needs the row on the host
    finally:
        e.logprobs_on_device = True
        loop.close()
    for (dev_tokens, dev_lps, dev_prompt), (host_tokens, host_lps, host_prompt) in zip(runs["device"], runs["host"]):
        assert dev_tokens == host_tokens
        for d, h in zip(list(dev_lps) + list(dev_prompt or ()), list(host_lps) + list(host_prompt or ())):
            assert abs(d.logprob - h.logprob) < 1e-5 and [t for t, _ in d.top] == [t for t, _ in h.top]
    assert runs["device"][1][2] is not None and len(runs["device"][1][2]) == len(prompt) - 1
