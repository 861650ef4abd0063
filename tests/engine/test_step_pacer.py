"""The step pacer (services/engine/step_pacer.py) and the scheduler cutting prompt chunks to it."""
from __future__ import annotations

import itertools
import statistics

from services.engine.engine_loop import EngineLoop
from services.engine.sampling import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from services.engine.step_pacer import StepPacer
from tests.engine.paged_fake import PagedFakeEngine


def test_the_cap_fits_the_target_from_measured_costs():
    p = StepPacer(target_s=0.1, floor=16, ceiling=512)
    assert p.cap() == 16  # nothing measured yet: a block, not the whole budget
    for _ in range(20):
        p.observe(4, 0, 0.02)  # decode-only steps: 20 ms
        p.observe(4, 100, 0.22)  # 100 prompt tokens cost 200 ms more: 2 ms each
    assert abs(p.base_s - 0.02) < 1e-9 and abs(p.per_token_s - 0.002) < 1e-9
    assert p.cap() == 40  # (0.1 - 0.02) / 0.002
    for _ in range(20):
        p.observe(4, 40, 0.02 + 40 * 0.01)  # the machine got 5x slower per prompt token (or the context grew)
    assert p.cap() == 16  # never below a block while steps at it keep within 1.5x the target
    assert StepPacer(0.0, 16, 512).cap() is None  # off


def test_a_block_dearer_than_the_target_halves_the_floor_but_the_prompt_always_advances():
    """A 2,000-token prompt beside 4 streams on PoCL: past ~1,500 cached positions a 16-token chunk took
    120-190 ms (decodes alone ~30 ms) and the streams' ITL p99 was 181-194 ms with a block as the floor.
    After such a step the floor is half a block; it comes back once a step at it takes half the target."""
    p = StepPacer(target_s=0.1, floor=16, ceiling=512)
    cost = lambda n: 0.03 + n * 0.009  # noqa: E731  9 ms a token at a long context: a block is a 174 ms step
    times = []
    for _ in range(30):
        p.observe(4, 0, 0.03)
        n = p.cap()
        times.append(cost(n))
        p.observe(4, n, times[-1])
    assert times[0] > 0.15 and max(times[1:]) <= 0.15, times  # one step of a block, then half a block (102 ms)
    p.observe(4, 8, 0.13)  # a step at the floor over its target, within 1.5x: halved all the same
    assert p.cap() == 8  # (never below half a block)
    slow = StepPacer(target_s=0.1, floor=16, ceiling=512)
    slow.observe(4, 0, 0.03)
    slow.observe(4, 16, 0.13)
    assert slow.floor_now == 8 and slow.cap() < 16  # (the model: 11 tokens fit)
    assert p.cap() == 8
    for _ in range(3):  # a shorter context: a block fits again
        p.observe(4, 0, 0.03)
        n = p.cap()
        p.observe(4, n, 0.03 + n * 0.002)
    assert p.cap() >= 16
    p.observe(4, 8, 0.13)  # long again: half a block
    assert p.floor_now == 8
    for _ in range(10):  # decodes alone past the target: a block again, the least it gets
        p.observe(40, 0, 0.12)
    p.observe(40, 8, 0.3)
    assert p.cap(n_decodes=40) == 16 and p.floor_now == 16


def test_a_slow_machine_never_makes_a_prompt_crawl():
    """On torch a 1-token step slowed by the machine once gave a sample of 60-90 ms a token (the true
    cost ~3 ms, the decode-only base stale): a floor from the per-token estimate fell to one token and
    a 2,000-token prompt took 36-56 s. The floor is never below half a block, and when the decodes alone
    fill the target it stays a block (fewer prompt tokens would not bring the step within it)."""
    p = StepPacer(target_s=0.1, floor=16, ceiling=512)
    p.observe(4, 0, 0.04)
    for _ in range(30):  # every step slowed to 0.2 s whatever its prompt tokens
        p.observe(4, p.cap(), 0.2)
    assert p.cap() == 8
    torch_like = StepPacer(target_s=0.1, floor=16, ceiling=512)
    for _ in range(10):  # decodes alone 70 ms, a block 60 ms more: halving would save too little of a step
        torch_like.observe(4, 0, 0.07)
        torch_like.observe(4, torch_like.cap(), 0.13)
    assert torch_like.floor_now == 16
    full = StepPacer(target_s=0.1, floor=16, ceiling=512)
    for _ in range(30):  # decodes alone 120 ms
        full.observe(40, 0, 0.12)
        full.observe(40, full.cap(n_decodes=40), 0.2)
    assert full.cap(n_decodes=40) == 16


def closed_loop(pacer: StepPacer, cost, steps: int = 100) -> list[float]:
    """The step times of a prompt chunked beside decodes at the pacer's caps, on an engine whose step
    with n prompt tokens takes cost(n) (decode-only steps between them keep the base measured)."""
    times = []
    for _ in range(steps):
        pacer.observe(4, 0, cost(0))
        n = pacer.cap()
        times.append(cost(n))
        pacer.observe(4, n, times[-1])
    return times


def test_a_stalled_decode_step_never_lets_the_cap_jump_to_the_whole_budget():
    """As measured in process (step_pacer.py's docstring): one decode-only step stalled by the machine
    lifted the base above the mixed steps that followed; their samples of 0 s a token drove the
    per-token estimate to ~0, and once the base came back the cap was the whole budget: 512 prompt
    tokens beside the streams. Costs here are torch's on this machine: 55 ms + 1.2 ms a prompt token."""
    cost = lambda n: 0.055 + 0.0012 * n  # noqa: E731
    p = StepPacer(0.1, 16, 512)
    assert max(closed_loop(p, cost, 10)) <= 0.1
    p.observe(4, 0, 1.273)  # one decode-only step stalls: the base EWMA ~0.42 s
    for _ in range(10):  # the next prompt's chunks, at their usual cost: faster than that base
        n = p.cap()
        p.observe(4, n, cost(n))
    for _ in range(10):  # decodes alone: the base comes back
        p.observe(4, 0, cost(0))
    assert cost(p.cap()) <= 0.1, p.cap()  # was 512 tokens: 0.67 s


def test_costs_that_are_not_linear_keep_the_steps_within_one_and_a_half_targets():
    """Prompt tokens nearly free while a step's weight pass dominates (the first 64 here), dear after:
    the cap grows from a block by measured steps, never straight to what the flat part extrapolates."""
    times = closed_loop(StepPacer(0.1, 16, 512), lambda n: 0.055 + 0.003 * max(0, n - 64))
    assert max(times) <= 0.15, max(times)


class PromptCostEngine(PagedFakeEngine):
    """A fake engine whose step takes 2 ms plus 1 ms per prompt token, as a device's would grow."""

    def step(self, chunks, greedy, on_layer=None):
        self.step_s = 0.002 + 0.001 * sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        return super().step(chunks, greedy, on_layer)


def mixed_steps(target_s: float) -> list[int]:
    """Prompt tokens of each step that also decoded, while a 200-token prompt arrives beside a stream."""
    engine = PromptCostEngine(256, block_size=4, max_num_batched_tokens=64)
    loop = EngineLoop(engine, SchedulerConfig(num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                              max_model_len=512, step_target_s=target_s))
    try:
        stream = loop.submit(list(range(1, 9)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        tokens = stream.events()
        next(tokens)  # decoding now (the iterator is kept: closing it would cancel the stream)
        long = loop.submit([i % 90 + 1 for i in range(200)], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        list(long.events())
        list(tokens)
    finally:
        loop.close()
    return [sum(n for _, _, n in step if n > 1) for step in engine.steps
            if any(n == 1 for _, _, n in step) and any(n > 1 for _, _, n in step)]


def test_the_engine_loop_paces_prompt_chunks_by_its_measured_step_times():
    unpaced = mixed_steps(0.0)
    assert max(unpaced) > 40  # the whole budget beside the decode: a 65 ms step
    paced = mixed_steps(0.02)  # 2 ms a decode step + 1 ms a prompt token: 18 tokens fit
    # the first mixed step, before anything was measured, takes a block; then the cap (timing noise on
    # a busy machine only makes the measured costs, so the cap, larger per token: fewer tokens)
    assert paced and paced[0] <= 4 and max(paced) <= 20, paced


def test_the_target_stretches_with_the_oldest_prompts_wait_past_the_ttft_target():
    p = StepPacer(0.1, 16, 512, ttft_target_s=2.0, max_s=0.4)
    assert [p.target_for(w) for w in (0.0, 1.9, 2.0)] == [0.1, 0.1, 0.1]  # a lone long prompt: the ITL target
    assert abs(p.target_for(3.0) - 0.25) < 1e-9  # half-way to twice the TTFT target: half-way to max_s
    assert p.target_for(4.0) == p.target_for(60.0) == 0.4
    assert StepPacer(0.1, 16, 512).target_for(60.0) == 0.1  # no TTFT target: never stretched


def first_tokens(ttft_target_s: float, prompts: list[int], step_tokens: int = 512,
                 stretched_tokens: int = 0) -> tuple[list[float], list[float], list[int]]:
    """30 streams decoding fill the 100 ms target (97 ms a step, as at 32 clients on this machine;
    3 ms a prompt token), then prompts of these lengths arrive at once: the simulated clock's seconds
    to each one's first token, and every step's time and prompt tokens until the last."""
    clock = [0.0]
    sched = Scheduler(SchedulerConfig(num_blocks=1000, block_size=16, max_num_seqs=64,
                                      max_num_batched_tokens=step_tokens, stretched_batched_tokens=stretched_tokens,
                                      max_model_len=4096, step_target_s=0.1, ttft_target_s=ttft_target_s,
                                      step_max_s=0.4), clock=lambda: clock[0])
    for i in range(30):
        sched.add(Sequence(i, [i + 1], 10_000))
    out = sched.schedule()  # the 30 one-token prompts: first tokens, then they decode
    sched.update(out, {c.seq_id: 9 for c in out.chunks})
    for i, n in enumerate(prompts):
        sched.add(Sequence(100 + i, [1000 * (i + 1) + j for j in range(n)], 5))  # no shared prefix
    firsts, steps, tokens = {}, [], []
    while len(firsts) < len(prompts):
        out = sched.schedule()
        tokens.append(sum(c.num_tokens for c in out.prefills))
        seconds = 0.097 + 0.003 * tokens[-1]
        steps.append(seconds)
        clock[0] += seconds
        sched.observe_step(out, seconds)
        sched.update(out, {c.seq_id: 9 for c in out.chunks if c.samples})
        firsts.update({c.seq_id: clock[0] for c in out.prefills if c.samples and c.seq_id >= 100})
    return [firsts[100 + i] for i in range(len(prompts))], steps, tokens


def test_queued_prompts_past_the_ttft_target_get_longer_steps_and_their_first_tokens_sooner():
    """The pacer alone gave prompts a block a step beside 30 decodes (at 32 clients decode_fpga ran 14
    and queued 18; TTFT p50 10.8 s). With the stretch, once the queue's head has waited 2 s the steps
    grow, the queue drains sooner, and no step exceeds 1.5x step_max_s."""
    queue = [272] * 8  # serve.py's mean prompt
    held, held_steps, _ = first_tokens(0.0, queue)
    stretched, steps, _ = first_tokens(2.0, queue)
    assert max(held_steps) < 0.15 and held[-1] > 18, held  # one block a step: 136 steps of 145 ms
    # (here 19.7 s to the last first token, 11.1 s on average; stretched 12.0 and 7.1)
    assert stretched[-1] < 0.7 * held[-1] and sum(stretched) < 0.7 * sum(held), (stretched, held)
    assert all(s <= h for s, h in zip(stretched, held)), (stretched, held)
    assert max(steps) <= 1.5 * 0.4 + 1e-9, max(steps)
    early = [s for s, t in zip(steps, itertools.accumulate(steps)) if t <= 2.0]
    assert early == held_steps[:len(early)]  # before the TTFT target nothing changes


def test_a_lone_long_prompt_never_stretches_the_streams_steps():
    """A 2,000-token prompt takes ~11 s a block at a time beside 30 decodes, far past the TTFT target,
    but it was admitted at once: it is not a queue, and the streams keep the ITL target (1.5x)."""
    firsts, steps, _ = first_tokens(2.0, [2000])
    assert firsts[0] > 10 and max(steps) < 0.15, (firsts, max(steps))
    _, steps, tokens = first_tokens(2.0, [2000], step_tokens=64, stretched_tokens=512)
    assert max(steps) < 0.15 and max(tokens) <= 64 - 30, (max(steps), max(tokens))  # nor its token budget


def test_a_stretched_step_may_compute_more_tokens_than_the_calm_budget():
    """decode_fpga's calm budget is 64 tokens a step, decodes included: beside 30 decodes a stretched
    0.4 s step still took 34 prompt tokens where ~100 fit (at 32 clients the queue stayed, TTFT p50
    8.3 s). Now the budget grows with the stretch, to 512 at twice the TTFT target."""
    queue = [272] * 8
    capped, capped_steps, capped_tokens = first_tokens(2.0, queue, step_tokens=64)
    grown, steps, tokens = first_tokens(2.0, queue, step_tokens=64, stretched_tokens=512)
    assert max(capped_tokens) == 64 - 30 and max(tokens) > 64, (max(capped_tokens), max(tokens))
    # (here the last first token 14.7 -> 12.0 s, the sum 66.8 -> 56.7 s; 34 -> 99 prompt tokens a step)
    assert grown[-1] < 0.85 * capped[-1] and sum(grown) < 0.9 * sum(capped), (grown, capped)
    assert max(steps) <= 1.5 * 0.4 + 1e-9, max(steps)
    early = [t for t, at in zip(tokens, itertools.accumulate(steps)) if at <= 2.0]
    assert early == capped_tokens[:len(early)] and max(early) <= 64 - 30  # before the TTFT target: the calm budget


def test_once_the_queue_is_served_a_step_takes_no_more_than_its_own_target_allowed():
    """Steps that met a stretched 0.4 s target carried ~100 prompt tokens; back at 0.1 s the next step
    must not take 1.5x those because they once fit."""
    p = StepPacer(0.1, 16, 512, ttft_target_s=2.0, max_s=0.4)
    for _ in range(10):
        n = p.cap(oldest_wait_s=5.0)
        p.observe(30, n, 0.097 + 0.003 * n)  # met the stretched target: fits grows
    grown = p.fits
    assert grown >= 60, grown
    p.per_token_s = None  # nothing measured of a token's cost: only the steps that fit bound it
    # a quarter of what fit the stretched steps (0.1 of 0.4 s), 1.5x: was 1.5x all of it
    assert p.cap(oldest_wait_s=0.0) <= 1.5 * grown / 4, (p.cap(0.0), grown)


def test_a_base_measured_with_fewer_rows_does_not_hold_a_full_batch_below_its_stretched_target():
    """Decode-only steps are measured at 8 rows (44 ms); then 60 rows run with a queue that never
    empties, so no step is decode-only again. Against the 8-row base a 60-row step's extra time looked
    like prompt tokens (13 ms each, 4x the truth) and the steps stayed at ~0.28 s of the 0.4 allowed."""
    cost = lambda rows, n: 0.02 + 0.003 * rows + 0.003 * n  # noqa: E731
    p = StepPacer(0.1, 16, 512, ttft_target_s=2.0, max_s=0.4)
    for _ in range(10):
        p.observe(8, 0, cost(8, 0))
    times = []
    for _ in range(40):
        n = p.cap(oldest_wait_s=10.0, n_decodes=60)
        times.append(cost(60, n))
        p.observe(60, n, times[-1])
    assert min(times[-10:]) >= 0.35 and max(times) <= 1.5 * 0.4, times


def test_prompts_queued_beside_few_streams_never_stretch_their_steps():
    """Four 2,000-token prompts arriving at once beside one stream queue past the TTFT target, but the
    stream's decodes take 20 ms of the 100 ms target: the prompts get 80 ms a step without a stretch,
    and a stretched 2 s step froze the stream for 2-3 s (bench/long_prompt_gaps.py, fpga and auto).
    The stretch is only for decodes that crowd prompts out (the 32-client tests above)."""
    clock = [0.0]
    sched = Scheduler(SchedulerConfig(num_blocks=2000, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                                      stretched_batched_tokens=512, max_model_len=4096, step_target_s=0.1,
                                      ttft_target_s=0.5, step_max_s=2.0), clock=lambda: clock[0])
    sched.add(Sequence(0, [1], 10_000))

    def step() -> tuple[float, int]:
        out = sched.schedule()
        tokens = sum(c.num_tokens for c in out.prefills)
        seconds = 0.02 * len(out.decodes) + 0.00075 * tokens  # 20 ms a decode row, ~130 prompt tokens a 100 ms
        clock[0] += seconds
        sched.observe_step(out, seconds)
        sched.update(out, {c.seq_id: 9 for c in out.chunks if c.samples})
        return seconds, tokens

    for _ in range(10):  # the stream decodes alone: the base is measured
        step()
    for i in range(4):
        sched.add(Sequence(100 + i, [1000 * (i + 1) + j for j in range(2000)], 5))
    steps, tokens = zip(*(step() for _ in range(700)))
    assert sched.pacer.pressure(1) == 0.0
    assert max(steps) < 0.15, max(steps)
    assert sum(tokens) == 4 * 2000, sum(tokens)  # every prompt prefilled: paced, not starved
    # 30 streams filling 97 ms of the target: the stretch is what it was
    p = StepPacer(0.1, 16, 512, ttft_target_s=0.5, max_s=2.0)
    for _ in range(10):
        p.observe(30, 0, 0.097)
    assert p.pressure(30) > 0.9 and p.target_for(1.0, 30) > 1.8, (p.pressure(30), p.target_for(1.0, 30))


def test_a_closed_loop_of_32_clients_does_not_settle_with_few_decodes_and_a_long_queue():
    """At 32 clients (fpga mode, the serve mix, the 2-core host) decode_fpga decoded ~9 streams while ~22
    prompts queued: a step of 9 decodes and ~13 prompt tokens took ~90 ms (9 ms and ~4 ms a row), the
    decodes alone ~45 ms of the 100 ms target, so the pressure was none, no step stretched, prompts got
    ~13 tokens a step, and as streams finished at the rate prompts got in, it stayed so: TTFT p50 43-54 s.
    Another run of the same command stretched (TTFT p50 23 s): which way a run went hung on its first
    steps. The queued prompts are decode rows once in, so they count toward the pressure: 9 + 23 rows
    fill the target, and the queue gets the stretched steps. (One stream and four long prompts, the test
    above, are 5 rows, ~25 ms: no stretch.)"""
    clock = [0.0]
    sched = Scheduler(SchedulerConfig(num_blocks=4000, block_size=16, max_num_seqs=64, max_num_batched_tokens=64,
                                      stretched_batched_tokens=512, max_model_len=4096, step_target_s=0.1,
                                      ttft_target_s=0.5, step_max_s=2.0), clock=lambda: clock[0])
    ids = itertools.count()

    def step():
        out = sched.schedule()
        seconds = 0.009 + 0.004 * sum(c.num_tokens for c in out.chunks)  # the weights' pass, ~4 ms a row
        clock[0] += seconds
        sched.observe_step(out, seconds)
        return out, seconds, sched.update(out, {c.seq_id: 9 for c in out.chunks if c.samples})

    for i in range(9):  # streams decoding, finishing one after another
        sched.add(Sequence(next(ids), [i + 1], 20 + 15 * i))
    for _ in range(5):
        step()
    arrived, ttfts, steps, decoding = {}, {}, [], []

    def client_sends():  # serve.py's mean prompt and output
        seq_id = next(ids)
        arrived[seq_id] = clock[0]
        sched.add(Sequence(seq_id, [100_000 + 1000 * seq_id + j for j in range(272)], 160))

    for _ in range(32 - 9):
        client_sends()
    while clock[0] < 120.0:
        out, seconds, finished = step()
        steps.append(seconds)
        decoding.append(len(out.decodes))
        ttfts.update({c.seq_id: clock[0] - arrived[c.seq_id] for c in out.prefills
                      if c.samples and c.seq_id not in ttfts})
        for _ in finished:
            client_sends()
    # (here TTFT p50 9.4 s with 28.8 decodes a step on average; with the decodes alone in the pressure
    # 42.5 s with 9.2, as the real run)
    assert statistics.median(ttfts.values()) < 20, statistics.median(ttfts.values())
    assert statistics.mean(decoding) > 20, statistics.mean(decoding)
    assert max(steps) <= 1.5 * 2.0, max(steps)


def test_with_no_step_target_the_queue_alone_stretches_the_budget():
    """HYBRIDSERVE_*_STEP_TARGET_S=0 turns the pacing off; the TTFT target may still grow the token budget,
    as before the pressure existed (and nothing divides by the zero target)."""
    p = StepPacer(0.0, 16, 512, ttft_target_s=0.5, max_s=2.0)
    p.observe(4, 0, 0.03)
    assert p.cap(oldest_wait_s=5.0, n_decodes=4) is None
    assert p.pressure(4) == 1.0 and p.stretch(1.0, 4) == 1.0
