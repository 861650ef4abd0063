"""How many prompt tokens a step may prefill while decodes run, from measured step times.

Chunked prefill alone keeps a long prompt from taking a whole step, but a chunk of
max_num_batched_tokens can still be slow: on PoCL a 512-token chunk took over a second, and every
stream decoding beside it waited that long for its next token (a 1262 ms gap where the median was
16 ms). The pacer learns two costs from the engine's own steps: a decode-only step (`base`, an
EWMA, with the rows it had) and the marginal seconds per row beyond it (an EWMA of (step - base) /
(prompt tokens + decode rows beyond the base's): a decode row and a prompt token are each one row
through the weights; attention over long contexts, which makes later chunks dearer, shows in it).
While decodes run, a step's prompt tokens are capped so that the base for its decode rows + cap x
per_token stays within `target_s`; at most the scheduler's own budget, and at least a floor so a prompt
always advances: a block, halved (down to half a block) after a step at the floor took more than
FLOOR_OVER x its target, mostly for its prompt tokens, while the decodes alone left room in it, doubled
back after one whose prompt part, twice, would have kept within that. A block alone was the floor until
a 2,000-token prompt beside 4 streams on PoCL (a 2.1 GHz Xeon): past ~1,500 cached positions a token's
attention made a 16-token chunk a 120-190 ms step (4 decodes alone: 30-40 ms), and the streams' ITL p99
was 181-214 ms against the 150 ms the pacer is for. The floor follows the steps themselves, not the
per-token estimate: a floor from that estimate shrank to one token on torch, where a 1-token step slowed
by the machine gave a sample of 60-90 ms a token (the true cost ~3 ms; the base, measured only by
decode-only steps, was stale) and a 2,000-token prompt took 36-56 s. Half a block bounds what a slow
machine costs a prompt's TTFT to 2x, and when the decodes alone fill the target, fewer prompt tokens
would not bring the step within it. With no decode running nothing waits on the step, and the cap is
off. target_s = 0 turns it off.

Two ways the estimate went wrong, measured in process on this machine (torch, 4 streams while
512-token prompts arrived, a busy machine): one decode-only step took 1273 ms, which lifted the
base EWMA to 367 ms; the mixed steps after it, faster than that stale base, each gave a sample of
0 s a token and the per-token EWMA fell to 0.000 ms. Had the base come back below the target
before a positive sample, the cap would have been the whole budget (512 tokens, ~2.5 s on torch
when busy: the size of the worst gaps of gpu mode's long-prompt bench, in both rounds). So (1) a
mixed step no slower than the decode-only base is no sample of a token's cost (it leaves the
estimate alone), and (2) a step carries at most GROWTH times the prompt tokens of the largest one
known to keep within the target (`fits`; halved by a step beside decodes that did not): the cap
grows by measured steps, never by extrapolation alone. Before anything is measured that is
`floor` tokens: the first step beside decodes that came by hand-off (an engine that never
prefilled, in hybrid or auto mode) took the whole budget.

Holding every step to the ITL target starves prompts once the decodes alone nearly fill it: at 32
clients on this machine 30 rows took ~97 ms of the 100, the cap was one block, decode_fpga ran 14
requests while 18 waited (it batches 64), and TTFT p50 was 10.8 s against llama-server's 3.2 s, whose
ITL was 155 ms to our 97. With the tokens/s fixed by the processor, a closed loop of clients trades
TTFT for ITL (Little's law): more requests decoding at once is a longer step and a shorter queue. So
the target stretches with the wait of the oldest prompt queued behind another (from the scheduler:
the second oldest without a first token, admitted or not): past `ttft_target_s` the step target
grows with that wait, from target_s to `max_s` at twice the TTFT target. The oldest does not count:
a lone long prompt (2,000 tokens) beside a few streams takes its chunks within the ITL target,
however long that takes; it is a queue of prompts, many clients, that gets the longer steps.
The scheduler's token budget stretches with it (`stretch`): decode_fpga's calm budget of 64 tokens,
decodes included, left 34 prompt tokens beside 30 decodes where a stretched step had room for ~100,
and its TTFT p50 at 32 clients stayed at 8.3 s; grown to 512 (with the stretch from 0.5 s of waiting
to 2 s steps) it was 3.4-3.55 s at 0.93-1.01x the tokens/s (bench/results/serve_32_prefill_first.json,
serve_stretched_budget_vs_before.json).

The stretch is for prompts the decodes starve, and only for them: it grows with how much of the calm
target the step's decodes alone fill (`pressure`: none while they take at most half of it, all of it when
they fill it). Four 2,000-token prompts arriving at once beside one stream queue past the TTFT target too,
but its decodes took 20 ms of the 100: each step still gave the prompts 80 ms, and stretching it to 2 s
froze the stream for 2.0-3.0 s (fpga and auto, bench/long_prompt_gaps.py) for a first token a few
seconds sooner. At 32 clients the decodes fill ~97% of it and the stretch is what it was.

The queued prompts count toward the pressure as the decode rows they become once in (`cap`'s `n_queued`).
With the decodes alone, a closed loop of 32 clients could settle with few of them: on the 2-core host
(fpga mode, the serve mix) decode_fpga decoded ~9 streams while ~22 prompts queued, a step of 9 decodes
and ~13 prompt tokens took ~90 ms (9 ms and ~4 ms a row), the decodes alone ~45 ms of the target, so no
step stretched, prompts got ~13 tokens a step, and TTFT p50 was 43-54 s. Another run of the same command
stretched (TTFT p50 23 s): which way a run went hung on its first steps. Counted, side by side in one
run: TTFT p50 6.2 s against 53.8, 79.0 against 66.9 tokens/s, ITL p99 1.95 s against 0.17
(bench/results/serve_32_queued_pressure.json). One stream and four long prompts are 5 rows, ~25 ms: still
no stretch (fpga's largest gap 132 ms, long_prompt_gaps_queued_pressure.json).
"""
from __future__ import annotations

ALPHA = 0.3  # EWMA weight of the newest step: follows a machine that gets busier within a few steps
# the most a step's prompt tokens may exceed those of a step known to keep within the target: with costs
# linear in the tokens a step then lasts at most 1.5 x target (150 ms for the default 0.1 s)
GROWTH = 1.5
# a step at the floor longer than this x its target halves the floor: below GROWTH, so that steps at the
# floor keep within the 1.5x bound with room for the machine's noise
FLOOR_OVER = 1.25
# the share of the calm target a step's decodes may fill before a queue of prompts stretches it at all
ROOM_FOR_PROMPTS = 0.5


class StepPacer:
    def __init__(self, target_s: float, floor: int, ceiling: int, ttft_target_s: float = 0.0,
                 max_s: float | None = None):
        self.target_s, self.floor, self.ceiling = target_s, floor, ceiling
        self.ttft_target_s = ttft_target_s  # 0: the target never stretches
        self.max_s = target_s if max_s is None else max(target_s, max_s)
        self.base_s: float | None = None  # a decode-only step
        self.base_rows = 0.0  # ...of this many decodes (an EWMA too)
        self.per_token_s: float | None = None  # one more prompt token in a step
        self.fits = 0  # the most prompt tokens a step beside decodes is known to keep within its target
        self.floor_now = floor  # the fewest prompt tokens a step beside decodes takes: floor, or down to half
        self.step_target_s = target_s  # the target of the step last capped (stretched or not)
        self.last_cap = 0  # the prompt tokens that step was allowed (a gauge)

    def stretch(self, oldest_wait_s: float, n_decodes: int | None = None, n_queued: int = 0) -> float:
        """How far the queue stretches a step, 0 (not at all) to 1 (at twice the TTFT target, decodes filling
        the calm target): its target (`target_for`) and the scheduler's token budget grow with it."""
        if self.ttft_target_s <= 0 or oldest_wait_s <= self.ttft_target_s:
            return 0.0
        rows = None if n_decodes is None else n_decodes + n_queued  # queued prompts: the decode rows they become
        return min(1.0, oldest_wait_s / self.ttft_target_s - 1.0) * self.pressure(rows)

    def pressure(self, n_decodes: int | None) -> float:
        """How much `n_decodes` decode rows crowd prompts out of a calm step: 0 while their base takes at
        most ROOM_FOR_PROMPTS of the target, 1 once it fills the target; 1 when nothing says (no rows
        given, no decode-only step measured yet, or no step target: the queue's wait alone decides, as before)."""
        if n_decodes is None or self.base_s is None or self.target_s <= 0:
            return 1.0
        share = self.base_for(n_decodes) / self.target_s
        return min(1.0, max(0.0, (share - ROOM_FOR_PROMPTS) / (1.0 - ROOM_FOR_PROMPTS)))

    def target_for(self, oldest_wait_s: float, n_decodes: int | None = None, n_queued: int = 0) -> float:
        """The step target while the oldest prompt queued behind another has waited `oldest_wait_s`."""
        return self.target_s + self.stretch(oldest_wait_s, n_decodes, n_queued) * (self.max_s - self.target_s)

    def observe(self, n_decodes: int, n_prefill_tokens: int, seconds: float) -> None:
        if n_prefill_tokens == 0:
            if n_decodes:
                first = self.base_s is None
                self.base_s = seconds if first else (1 - ALPHA) * self.base_s + ALPHA * seconds
                self.base_rows = n_decodes if first else (1 - ALPHA) * self.base_rows + ALPHA * n_decodes
            return
        if n_decodes:  # the streams waited on this step
            self.fits = max(self.fits, n_prefill_tokens) if seconds <= self.step_target_s else n_prefill_tokens // 2
            if n_prefill_tokens <= self.floor_now:  # a step at the floor: was the floor too much?
                self._adjust_floor(seconds)
        # a step of prompt tokens alone still pays the weights' pass: that part is the base; rows beyond
        # the base's, decode rows or prompt tokens alike, cost the same each (one row through the weights)
        extra = seconds - (self.base_s or 0.0)
        rows = n_prefill_tokens + (n_decodes - self.base_rows if self.base_s is not None else 0)
        if extra <= 0 or rows <= 0:
            return  # as fast as decodes alone: says nothing of what a token costs (see the docstring)
        sample = extra / rows
        self.per_token_s = sample if self.per_token_s is None else (1 - ALPHA) * self.per_token_s + ALPHA * sample

    def base_for(self, n_decodes: int | None) -> float:
        """A decode-only step of `n_decodes` rows: the measured base, plus or minus a row's cost per row.
        Under a steady queue no step is decode-only, and the base measured with fewer rows is stale:
        taken as is, a full batch's extra time looked like dear prompt tokens (a base of 8 rows held
        a 60-row batch at 0.28 s of a stretched 0.4: test_step_pacer.py)."""
        if self.base_s is None:
            return 0.0
        if n_decodes is None:  # rows not said: as many as the base's
            return self.base_s
        return max(0.0, self.base_s + (n_decodes - self.base_rows) * (self.per_token_s or 0.0))

    def cap(self, oldest_wait_s: float = 0.0, n_decodes: int | None = None, n_queued: int = 0) -> int | None:
        """Prompt tokens a step with decodes may take; None: no cap (off). `oldest_wait_s`: how long the
        oldest prompt queued behind another has waited (it stretches the target, see the docstring);
        `n_decodes`: the step's decode rows; `n_queued`: prompts without a first token, which count
        toward the pressure as the decode rows they will be."""
        if self.target_s <= 0:
            return None
        target = self.target_for(oldest_wait_s, n_decodes, n_queued)
        if target < self.step_target_s:  # the queue is served: what fit a stretched step fits less now
            self.fits = int(self.fits * target / self.step_target_s)
        self.step_target_s = target
        cap = int(self.fits * GROWTH)  # measured steps first: the model is not trusted beyond them
        if self.per_token_s:
            cap = min(cap, int((target - self.base_for(n_decodes)) / self.per_token_s))
        self.last_cap = max(self.floor_now, min(self.ceiling, cap))
        return self.last_cap

    def _adjust_floor(self, seconds: float) -> None:
        """After a step at the floor: halve it (to half of `floor` at least) if the step took more than
        FLOOR_OVER x its target and its prompt tokens the larger part of it, double it back (to `floor`
        at most) if twice its prompt tokens would not have (this step's own time beyond the base,
        twice). Only while a measured decode-only step leaves room in the target: when the decodes alone
        fill it, fewer prompt tokens would not bring a step within it, and the floor is a block. The
        larger part: halving the prompt tokens then saves at least a quarter of the step. On torch (4
        decodes 65-75 ms, a block at 2,000 positions ~60 ms more) halving saved nothing measurable in
        the streams' p99 (183-187 against 176-192 ms) and cost the prompts 18% TTFT; on PoCL (decodes
        25-35 ms, a block 100-130 ms more) it brought the p99 from 199-214 to 126-135 ms."""
        bound = FLOOR_OVER * self.step_target_s
        if self.base_s is None or self.base_s >= self.step_target_s:
            self.floor_now = self.floor
        elif seconds > bound and seconds - self.base_s > self.base_s:
            self.floor_now = max(self.floor // 2, 1, self.floor_now // 2)
        elif 2 * seconds - self.base_s <= bound:
            self.floor_now = min(self.floor, self.floor_now * 2)
